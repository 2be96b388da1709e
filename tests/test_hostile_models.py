"""Hostile model sources for ``profiling.export``: hf: configs and model factories.

The hf: cases are generated from the bundled configs (``profiling/hf/configs/``): every integer
field of each gets a type swap (a string, a float, a boolean, an array, an object), null (where
its transformers class does not allow None), a number beyond int64, zero and a negative value;
plus the cases of issue 27 (a hidden size of 1e9, 7 heads for 768, vocab 0, 100,000 layers, deep
nesting) and the same values through ``--set``. The factories raise, recurse, have a syntax
error, import a missing package, call ``sys.exit(0)`` or ``sys.exit(3)`` (at import, in the
factory, in the model's build or forward), or loop forever under a short ``--time-limit``.

Each must end with a non-zero exit, exactly one line on stderr (no traceback, no torch log) and
no output file; the exit code is 2 (4 at the time limit). A few values are harmless to the
profile (a token id of -1, a sliding window of 0, no decoder blocks): those may instead profile
(exit 0) to a graph that loads. The generated cases run through ``main(argv)`` in ONE
subprocess (a crash of the interpreter fails the test, not pytest; stdout and stderr captured at
the file descriptors, so a C++ or logging write counts); representative ones run in-process in
the fast tier, and real ``python -m`` runs in the slow one.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from profiling.export import main  # noqa: E402
from profiling.hf.checks import _kinds, check_config  # noqa: E402
from profiling.hf.config import CONFIG_DIR, bundled_configs  # noqa: E402
from solver.errors import InputError  # noqa: E402
from solver.graph import load_graph  # noqa: E402
from tests.processes import run_driver, run_export  # noqa: E402

MAX_LINE = 400
"""An error line is shorter than this (characters)."""
LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers")
"""The layer counts of the bundled configs: set to 1 in every generated case (unless the case is
about that field), so a case that profiles takes about a second."""
HARMLESS = ("_token_id", "sliding_window", "relative_attention_max_distance", "decoder_sparse_step")
"""Fields (name endings) where zero or a negative value may profile: token ids (the Hub has
``pad_token_id: -1``), windows and buckets the forward reads at run time only."""
STANDARD = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
STANDARD += ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
STANDARD += ("num_experts", "num_labels")
"""transformers' standard sizes (each class maps its own names to them): never 0."""

FACTORIES = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    from models import ModelSpec

    def raises():
        raise ValueError("no such model\\nsecond line")

    def recurses():
        return recurses()

    def exits_0():
        sys.exit(0)

    def exits_3():
        sys.exit(3)

    def imports_missing():
        import no_such_package_for_memplan  # noqa: F401

    def loops():
        while True:
            try:
                while True:
                    pass
            except Exception:  # a factory that swallows what it can
                pass

    def sleeps():
        time.sleep(10_000)

    def _spec(build, inputs=lambda batch, seq: (torch.randn(batch, 4),)):
        return ModelSpec(
            name="hostile", config=None, build=build, example_inputs=inputs, layers=None,
            seq_len=None,
        )

    class Exits(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            sys.exit(0)

    class Fails(Exits):
        def forward(self, x):
            raise RuntimeError("forward broke")

    def build_raises():
        return _spec(lambda: (_ for _ in ()).throw(RuntimeError("build broke")))

    def build_exits():
        return _spec(lambda: sys.exit(0))

    def forward_exits():
        return _spec(Exits)

    def forward_raises():
        return _spec(Fails)

    def inputs_raise():
        return _spec(Exits, inputs=lambda batch, seq: {}["x"])
    """
)
"""The module ``hostile_factories``: one factory per way to fail."""

FACTORY_CASES = {
    # factory -> (exit code, words the line holds)
    "hostile_factories:raises": (2, "raised ValueError: no such model second line"),
    "hostile_factories:recurses": (2, "raised RecursionError"),
    "hostile_factories:exits_0": (2, "exited (SystemExit with code 0)"),
    "hostile_factories:exits_3": (2, "exited (SystemExit with code 3)"),
    "hostile_factories:imports_missing": (2, "raised ModuleNotFoundError"),
    "hostile_syntax:spec": (2, "raised SyntaxError"),
    "hostile_import:spec": (2, "raised ModuleNotFoundError"),
    "hostile_exit:spec": (2, "exited (SystemExit with code 0)"),
    "hostile_factories:build_raises": (2, "building the model raised RuntimeError: build broke"),
    "hostile_factories:build_exits": (2, "building the model exited"),
    "hostile_factories:forward_raises": (2, "RuntimeError: forward broke"),
    "hostile_factories:forward_exits": (2, "exited (SystemExit with code 0)"),
    "hostile_factories:inputs_raise": (2, "making its inputs raised KeyError"),
    "hostile_factories:loops": (4, "stopped at the time limit (--time-limit 1 s)"),
    "hostile_factories:sleeps": (4, "stopped at the time limit (--time-limit 1 s)"),
}
OTHER_MODULES = {
    "hostile_syntax.py": "def spec(:\n",
    "hostile_import.py": "import no_such_package_for_memplan\n",
    "hostile_exit.py": "import sys\nsys.exit(0)\n",
}


def write_factories(folder: Path) -> None:
    (folder / "hostile_factories.py").write_text(FACTORIES)
    for name, text in OTHER_MODULES.items():
        (folder / name).write_text(text)


# -- the generated hf: cases -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    document: dict[str, Any] | str | None
    """The config.json (a str: its text as it is); None: the bundled config by name."""
    base: str
    argv: tuple[str, ...] = ()
    strict: bool = True
    """Exit 2 required (False: a harmless value, which may also profile to a graph)."""
    field: str | None = None
    """A name the error line must hold."""


def _small(name: str) -> dict[str, Any]:
    document = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    return {key: 1 if key in LAYER_KEYS else value for key, value in document.items()}


def _optional(name: str, key: str) -> bool:
    """Whether transformers' class of bundled config ``name`` lets ``key`` be null."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[_small(name)["model_type"]]
    key = config_class.attribute_map.get(key, key)
    types = {field.name: str(field.type) for field in dataclasses.fields(config_class)}
    return "None" in types.get(key, "None")


def field_cases(name: str) -> list[Case]:
    """Every integer field of bundled config ``name``, each hostile value."""
    small, cases = _small(name), []
    for key, value in small.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        harmless = key.endswith(HARMLESS)
        variants: dict[str, tuple[Any, bool]] = {
            "string": (str(value), True),
            "float": (value + 0.5, True),
            "bool": (True, True),
            "array": ([value], True),
            "object": ({"value": value}, True),
            "beyond-int64": (2**64, True),
            "negative": (-1, not harmless),
            "zero": (0, key in _standard_names(name)),
        }
        if not _optional(name, key):
            variants["null"] = (None, True)
        for variant, (bad, strict) in variants.items():
            cases.append(
                Case(f"{name}/{key}/{variant}", {**small, key: bad}, name, (), strict, key)
            )
    return cases


def _standard_names(name: str) -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    aliases = CONFIG_MAPPING[_small(name)["model_type"]].attribute_map
    return {aliases.get(key, key) for key in STANDARD}


def issue_cases() -> list[Case]:
    """The hostile configs of issue 27, as files and as --set."""
    gpt2 = _small("gpt2")
    nested: Any = 1
    for _ in range(100):
        nested = {"a": nested}
    return [
        Case("issue/hidden-1e9", {**gpt2, "n_embd": 10**9, "n_head": 8}, "gpt2", field="n_embd"),
        Case("issue/7-heads", {**gpt2, "n_head": 7}, "gpt2", field="n_head"),
        Case("issue/vocab-0", {**gpt2, "vocab_size": 0}, "gpt2", field="vocab_size"),
        Case("issue/n_layer-string", {**gpt2, "n_layer": "12"}, "gpt2", field="n_layer"),
        Case("issue/positions-negative", {**gpt2, "n_positions": -5}, "gpt2", field="n_positions"),
        Case("issue/100000-layers", {**gpt2, "n_layer": 100_000}, "gpt2", field="--max-layers"),
        Case("issue/nested-100", {**gpt2, "extra": nested}, "gpt2", field="64 levels"),
        Case(
            "issue/nested-100000",
            '{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "gpt2",
            field="nest",
        ),
        Case("issue/architectures-5", {**gpt2, "architectures": 5}, "gpt2", field="architectures"),
        Case("issue/gqa-3", {**_small("llama-2-7b"), "num_key_value_heads": 3}, "llama-2-7b"),
        Case("set/n_layer-string", None, "gpt2", ("--set", "n_layer=abc"), field="n_layer"),
        Case("set/n_head-7", None, "gpt2", ("--set", "n_head=7", "--set", "n_layer=1"), True),
        Case("set/vocab-0", None, "gpt2", ("--set", "vocab_size=0"), field="vocab_size"),
        Case("set/hidden-1e9", None, "gpt2", ("--set", "n_embd=1000000000"), field="n_embd"),
        Case("set/layers-100000", None, "llama-2-70b", ("--set", "num_hidden_layers=100000")),
        Case("set/nested", None, "gpt2", ("--set", "n_inner=" + "[" * 200 + "]" * 200)),
        Case("set/dropout-5", None, "gpt2", ("--set", "resid_pdrop=5", "--set", "n_layer=1")),
        Case("set/activation", None, "gpt2", ("--set", "activation_function=nope"), field="nope"),
    ]


def hf_cases() -> list[Case]:
    return [case for name in bundled_configs() for case in field_cases(name)] + issue_cases()


def case_argv(case: Case, folder: Path, out: Path) -> list[str]:
    if case.document is None:
        model = f"hf:{case.base}"
    else:
        path = folder / (case.id.replace("/", "--") + ".json")
        text = case.document if isinstance(case.document, str) else json.dumps(case.document)
        path.write_text(text)
        model = f"hf:{path}"
    seq = [] if case.base.startswith("vit") else ["--seq", "16"]
    return [model, *seq, *case.argv, "--out", str(out), "--no-progress"]


# -- the driver --------------------------------------------------------------------------------

DRIVER = r"""
import json, os, sys, tempfile, time, traceback
sys.path.insert(0, sys.argv[3])
from profiling.export import main

def captured(argv):
    # stdout and stderr at the file descriptors: torch's C++ and logging writes count
    files = [tempfile.TemporaryFile(mode="w+b") for _ in range(2)]
    sys.stdout.flush(); sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    try:
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            code = "traceback"
            sys.stderr.write(traceback.format_exc())
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    texts = []
    for file in files:
        file.seek(0)
        texts.append(file.read().decode("utf-8", "replace"))
    return code, texts

results = {}
for entry in json.load(open(sys.argv[1])):
    started = time.perf_counter()
    code, (out, err) = captured(entry["argv"])
    seconds = time.perf_counter() - started
    results[entry["id"]] = {"code": code, "out": out, "err": err, "s": seconds}
json.dump(results, open(sys.argv[2], "w"))
"""
"""Runs every command line of the manifest in this one interpreter (``main(argv)``), recording
exit code, stdout, stderr and seconds; a traceback is recorded, not raised."""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[str, Any]:
    """{case id: record} of every generated hf: case and every factory case."""
    work = tmp_path_factory.mktemp("hostile-models")
    write_factories(work)
    manifest = []
    for case in hf_cases():
        out = work / "out" / (case.id.replace("/", "--") + ".graph.json")
        out.parent.mkdir(exist_ok=True)
        manifest.append({"id": case.id, "argv": case_argv(case, work, out), "out": str(out)})
    for factory in FACTORY_CASES:
        out = work / "out" / f"{factory.replace(':', '--')}.graph.json"
        argv = [factory, "--time-limit", "1", "--out", str(out), "--no-progress"]
        manifest.append({"id": factory, "argv": argv, "out": str(out)})
    results = run_driver(DRIVER, manifest, work, str(work), timeout=900, HF_HUB_OFFLINE="1")
    for entry in manifest:
        results[entry["id"]]["wrote"] = Path(entry["out"]).exists()
        results[entry["id"]]["out_path"] = entry["out"]
    return results


def check_one_line_error(record: dict[str, Any], code: int = 2) -> None:
    err = record["err"]
    assert record["code"] != "traceback" and "Traceback" not in err, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"{len(lines)} stderr lines: {err[:2000]!r}"
    assert lines[0].startswith("error: ") and len(lines[0]) < MAX_LINE, lines[0]
    assert record["code"] == code, f"exit {record['code']}: {err!r}"
    assert not record["wrote"], "an output file was written"


HF_CASES = hf_cases()


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in HF_CASES if c.strict], ids=lambda c: c.id)
def test_a_hostile_hf_config_is_exit_2_in_one_line(outcome, case):
    record = outcome[case.id]
    check_one_line_error(record)
    if case.field:
        assert case.field in record["err"], record["err"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in HF_CASES if not c.strict], ids=lambda c: c.id)
def test_a_harmless_value_profiles_or_is_refused_in_one_line(outcome, case):
    record = outcome[case.id]
    if record["code"] == 0:
        assert record["err"] == "", record["err"]
        assert load_graph(record["out_path"]).num_layers > 0
    else:
        check_one_line_error(record)


@pytest.mark.slow
@pytest.mark.parametrize("factory", list(FACTORY_CASES))
def test_a_hostile_factory_is_one_line_and_never_exit_0(outcome, factory):
    code, words = FACTORY_CASES[factory]
    record = outcome[factory]
    check_one_line_error(record, code)
    assert words in record["err"], record["err"]
    if code == 4:
        assert record["s"] < 5, f"stopped after {record['s']:.1f} s at a 1 s limit"


@pytest.mark.slow
def test_refusals_come_before_any_build(outcome):
    """Every refused hf: case of the checks (not of the build) ends in well under a second."""
    slow = {
        case.id: round(outcome[case.id]["s"], 2)
        for case in HF_CASES[1:]  # the first imports torch and transformers
        if case.strict and case.argv == () and outcome[case.id]["s"] > 1.0
    }
    assert not slow, slow


# -- in-process cases (the fast tier runs the first of each) -----------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["hf:gpt2", "--set", "n_layer=12.5"], "n_layer: a number (12.5), not an integer"),
        (["hf:gpt2", "--set", 'n_layer="12"'], "n_layer: a string ('12'), not an integer"),
        (["hf:gpt2", "--set", "n_layer=null"], "n_layer: null, not an integer"),
        (["hf:gpt2", "--set", "n_head=7"], "n_head 7 does not divide n_embd 768"),
        (["hf:gpt2", "--set", "vocab_size=0"], "vocab_size: 0 is out of range"),
        (["hf:gpt2", "--set", "n_positions=-5"], "n_positions: -5 is out of range"),
        (["hf:gpt2", "--set", "n_embd=1000000000", "--set", "n_head=8"], "past torch's limit"),
        (["hf:llama-2-7b", "--set", "num_key_value_heads=5"], "does not divide"),
        (["hf:gpt2", "--set", "n_layer=100000"], "100,000 blocks to profile (n_layer 100,000)"),
        (["gpt-tiny", "--set", "layers=5000"], "5,000 blocks to profile (layers 5,000)"),
        (["hf:t5-base", "--seq", "1000000000"], "holds 1,000,000,000 elements, over"),
        (
            ["hf:vit-base-patch16-224", "--set", "image_size=100000"],
            "pixel_values of shape (1, 3, 100000, 100000)",
        ),
    ],
)
def test_hostile_hf_values_are_one_line_exit_2(argv, words, run_cli, tmp_path):
    out = tmp_path / "g.json"
    started = time.perf_counter()
    code, _, err = run_cli(main, *argv, "--out", str(out), "--no-progress")
    assert code == 2 and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
    assert time.perf_counter() - started < 5  # refused before any model is built


def test_deep_nesting_is_refused_by_the_shared_reader(write_json, run_cli):
    deep = "[" * 100_000 + "]" * 100_000
    path = write_json("config.json", '{"model_type": "gpt2", "x": ' + deep + "}")
    code, _, err = run_cli(main, f"hf:{path}", "--no-progress")
    assert code == 2 and "nests at most 64 levels" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
        ('{"model_type": "gpt2", "x": ' + "[" * 100 + "]" * 100 + "}", "deeper than 64 levels"),
        ('{"model_type": "gpt2", "n_layer": "12"}', "n_layer: a string ('12')"),
    ],
)
def test_a_hostile_cached_config_is_one_line(text, words, tmp_path, monkeypatch, run_cli):
    """A config.json in the HF cache (read by transformers, then checked as a file would be)."""
    import huggingface_hub

    snapshot = tmp_path / "models--acme--bad" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(text)
    (tmp_path / "models--acme--bad" / "refs").mkdir()
    (tmp_path / "models--acme--bad" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    code, _, err = run_cli(main, "hf:acme/bad", "--no-progress")
    assert code == 2 and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """The hostile factory modules importable (fresh for each test)."""
    write_factories(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hostile_factories", *(Path(file).stem for file in OTHER_MODULES)):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "factory", [name for name, (code, _) in FACTORY_CASES.items() if code == 2]
)
def test_a_hostile_factory_in_process(factory, factories, run_cli):
    out = factories / "g.json"
    code, _, err = run_cli(main, factory, "--out", str(out), "--no-progress")
    assert (code, err.count("\n")) == (2, 1), err
    assert FACTORY_CASES[factory][1] in err and "Traceback" not in err
    assert not out.exists()


def test_an_endless_factory_stops_at_the_time_limit(factories, run_cli):
    started = time.perf_counter()
    code, _, err = run_cli(main, "hostile_factories:loops", "--time-limit", "0.2", "--no-progress")
    assert code == 4 and "stopped at the time limit (--time-limit 0.2 s)" in err, err
    assert err.count("\n") == 1
    assert time.perf_counter() - started < 2


# -- the checks themselves ---------------------------------------------------------------------


def test_annotation_kinds():
    assert _kinds(int) == {"int"}
    assert _kinds("int | None") == {"int", "none"}
    assert _kinds(float | int) == {"float", "int"}
    assert _kinds("dict[int, str] | None") is None  # not checked
    assert _kinds("Literal['a'] | None") is None


def test_bundled_configs_pass_the_checks():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for name in bundled_configs():
        raw = json.loads((CONFIG_DIR / f"{name}.json").read_text())
        check_config(CONFIG_MAPPING[raw["model_type"]], raw, {}, source=name)
    with pytest.raises(InputError, match=r"--set n_layer: a string \('2'\), not an integer; "):
        check_config(CONFIG_MAPPING["gpt2"], {}, {"n_layer": "2"}, source="x")
    # numbers written as integers (a dropout of 0), -1 token ids, 0 counts: not refused
    fine = {"hidden_dropout_prob": 0, "pad_token_id": -1, "num_labels": 3, "type_vocab_size": 1}
    check_config(CONFIG_MAPPING["bert"], {}, fine, source="x")
    check_config(CONFIG_MAPPING["qwen2_moe"], {}, {"max_window_layers": 0}, source="x")


@pytest.mark.slow
def test_every_default_config_of_transformers_passes_the_checks():
    """No false alarm: the default config of each of transformers' config classes (about 800)
    passes every check (the rules are generic, not a list of models), also with its whole
    numbers written as JSON integers (``"attention_dropout": 0``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from profiling.hf.models import quiet_transformers

    refused, checked = [], 0
    with quiet_transformers():
        for model_type in CONFIG_MAPPING.keys():
            config_class = CONFIG_MAPPING[model_type]
            try:
                raw = config_class().to_dict()
            except Exception:  # noqa: BLE001 - a class without usable defaults
                continue
            checked += 1
            whole = {key: _whole(value) for key, value in raw.items()}  # 0.0 written as 0
            for document in (raw, whole):
                try:
                    check_config(config_class, document, {}, source=model_type)
                except InputError as error:
                    refused.append(str(error))
    assert checked > 100 and not refused, refused


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# -- real processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_python_m_exits_non_zero_without_a_graph(tmp_path):
    write_factories(tmp_path)
    out = tmp_path / "g.json"
    for argv, code in [
        (["hostile_factories:exits_0"], 2),
        (["hostile_factories:loops", "--time-limit", "2"], 4),
        (["hf:gpt2", "--set", "n_layer=100000"], 2),
    ]:
        started = time.perf_counter()
        done = run_export(*argv, "--out", str(out), cwd=tmp_path, timeout=120, on_path=tmp_path)
        assert done.returncode == code, (argv, done.stderr)
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert not out.exists()
        assert time.perf_counter() - started < 60  # interpreter and torch start included
