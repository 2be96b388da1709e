"""Markdown tables for the benchmark scripts' result files."""

from __future__ import annotations

from pathlib import Path


def markdown_table(rows: list[dict], columns: list[str], float_format: str = "") -> list[str]:
    """Lines of a Markdown table; floats use ``float_format`` (e.g. ".3f") when given."""

    def cell(value) -> str:
        if isinstance(value, float) and float_format:
            return format(value, float_format)
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


def write_report(out_dir: str | Path, name: str, lines: list[str], *, note: str = "") -> Path:
    """Write ``lines`` as ``out_dir/name`` (creating the folder), say where (and ``note``),
    return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text("\n".join(lines))
    print(f"wrote {path}{note}")
    return path
