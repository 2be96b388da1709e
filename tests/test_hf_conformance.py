"""Every published HF architecture of tests/hf_families.py as a new user runs it (issue 28):
``profiling.export hf:<dir>`` with default flags exits 0 (or 2 with one line for a refused
family) and counts exactly the parameters transformers builds; a pinned pp 2 x tp 2 plan exists
(pp 2 x tp 1 after the one-line refusal where Megatron-core refuses tp 2 for the heads), and its
Megatron export gives the family's transformer blocks and --bf16, its torchtitan export names
only modules of torchtitan's model (or none), and its layers are modules of the model.

About 5-30 s a family (the export profiles the full-size model on fake tensors):
``scripts/bench_conformance.py`` writes the same checks as benchmarks/conformance.md.
"""

from __future__ import annotations

import pytest

from tests.hf_conformance import CHECKS, check_family, run_cli, write_config
from tests.hf_families import FAMILIES, REFUSED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def test_at_least_25_families_with_distinct_architectures():
    architectures = {family.config["architectures"][0] for family in FAMILIES.values()}
    assert len(FAMILIES) >= 25 and len(architectures) >= 25


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(REFUSED)))
def test_family_exports_plans_and_names_its_blocks(name, folder):
    row = check_family(name, folder)
    failed = {check: row[check] for check in CHECKS if not str(row[check]).startswith("ok")}
    assert not failed, failed


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_family_is_one_line(name, folder):
    from profiling.export import main as export_main

    config_dir = write_config(name, folder)
    out = folder / f"{name}.graph.json"
    code, err = run_cli(export_main, [f"hf:{config_dir}", "--out", str(out), "--no-progress"])
    lines = [line for line in err.splitlines() if not line.startswith("seq ")]
    assert code == 2 and len(lines) == 1 and REFUSED[name] in lines[0], err
    assert "Traceback" not in err and not out.exists()
