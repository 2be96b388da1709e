"""The plan JSON as a contract: the schema (docs/plan.schema.json) validates every kind of plan
the CLIs write, load_plan gives one-line errors, solver.evaluate --plan reproduces a plan's
per-stage peaks to the byte and its times, and evaluate() rejects training options that
contradict the config."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest

from solver import ParallelConfig, TrainingConfig, evaluate, load_plan
from solver.calibration import Calibration, write_calibration
from solver.cli import evaluate_main, plan_main
from solver.errors import InputError
from solver.files.plan_file import PLAN_VERSION, evaluate_plan, plan_differences
from solver.graph import load_graph
from solver.report.plan_report import checked
from tests.conftest import slow_params
from tests.test_empirical import statistics_graph

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt-1.3b.json")
T5 = str(ROOT / "examples" / "t5-dag.json")
HETEROGENEOUS = str(ROOT / "examples" / "clusters" / "a100-40g-80g.json")
SCHEMA = json.loads((ROOT / "docs" / "plan.schema.json").read_text())  # through the symlink

BASE = ["--gpus", "8", "--global-batch", "32", "--time-limit", "30", "--quiet"]
SHORT = ["--time-limit", "5"]
"""Instead of BASE's 30 s (argparse keeps the last): the interleaved searches are not proven
within 30 s either (CP-SAT's 6 configs stop at their shares of the limit, so the plan already
depended on the machine's speed); the tests read the plan's kind, fields and reproducibility,
which any plan the search writes has, and a feasible split comes within 0.1 s."""
KINDS = {
    # four stages: the errors below name them; no SP, as plans written before it
    "1f1b": [GPT, *BASE, "--pp", "4", "--sequence-parallel", "off"],
    "gpipe": [GPT, *BASE, "--schedule", "gpipe"],
    "interleaved": [GPT, *BASE, "--pp", "4", "--virtual-stages", "2", *SHORT],
    "interleaved-outputs-kept": [GPT, *BASE, "--pp", "4", "--virtual-stages", "2", *SHORT]
    + ["--no-deallocate-pipeline-outputs"],
    "selective": [GPT, *BASE, "--recompute", "selective", "--gpu-memory", "8GiB"],
    "full-zero-throughput": [GPT, *BASE, "--recompute", "full", "--zero", "auto"]
    + ["--objective", "throughput", "--runtime", "torch", "--bytes-per-param", "2,4,12"],
    "heterogeneous": [GPT, "--cluster", HETEROGENEOUS, "--global-batch", "64", "--quiet"]
    + ["--time-limit", "30"],
    "t5-dag": [T5, *BASE],
    "sequence-parallel": [GPT, *BASE, "--pp", "2", "--tp", "4", "--sequence-parallel", "on"],
    "calibrated": [GPT, *BASE, "--calibration", "{calibration}"],
    "empirical": ["{stats}", "--gpus", "4", "--global-batch", "4", "--memory-model", "empirical"]
    + ["--max-slowdown", "none", "--quiet"],
}


SEARCHED = ("interleaved", "interleaved-outputs-kept", "selective", "heterogeneous")
"""The kinds whose plan takes seconds to search (the rest take a fraction of one): the tests that
read them are slow."""


class Plans(dict):
    """Plan files by kind, each written by python -m solver.plan --json when first asked for."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        calibration = folder / "calibration.json"
        scales = {"weights": 0.97, "activations": 1.1}
        write_calibration(calibration, Calibration(scales=scales, constant_bytes=123_456_789))
        stats = folder / "stats.json"
        statistics_graph(random.Random(7), 12).save(stats)
        self.formats = {"calibration": calibration, "stats": stats}

    def __missing__(self, kind: str) -> Path:
        path = self.folder / f"{kind}.json"
        argv = [arg.format(**self.formats) for arg in KINDS[kind]]
        assert plan_main([*argv, "--json", str(path)]) == 0, kind
        self[kind] = path
        return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Plans:
    """Plan files of every kind, written by python -m solver.plan --json (once per module)."""
    return Plans(tmp_path_factory.mktemp("plans"))


def _run(main, argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as error:  # argparse errors
        code = error.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- the schema --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", slow_params(KINDS, *SEARCHED))
def test_schema_validates_every_kind_of_plan(plans, kind):
    document = json.loads(plans[kind].read_text())
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert (document["format"], document["version"]) == ("plan", PLAN_VERSION)
    plan = load_plan(plans[kind])
    assert plan.stage_peak_bytes == [s["peak_bytes"] for s in document["stages"]]
    assert plan.peak_bytes == document["peak_bytes"] == max(plan.stage_peak_bytes)
    assert plan.config == ParallelConfig(**document["config"])
    assert plan.graph.sha256 == load_graph(plan.graph.path).sha256()


@pytest.mark.slow
def test_schema_validates_evaluations_and_pareto_fronts(tmp_path, capsys):
    evaluation, front = tmp_path / "evaluation.json", tmp_path / "pareto.json"
    argv = [GPT, "--pp", "4", "--tp", "2", "--global-batch", "32", "--split", "even"]
    assert _run(evaluate_main, [*argv, "--quiet", "--json", str(evaluation)], capsys)[0] == 0
    argv = [GPT, *BASE, "--pareto", "--pareto-points", "3", "--json", str(front)]
    assert _run(plan_main, argv, capsys)[0] == 0
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for path, kind in ((evaluation, "evaluation"), (front, "pareto")):
        document = json.loads(path.read_text())
        validator.validate(document)
        assert document["format"] == kind
    assert load_plan(evaluation).exports is None
    with pytest.raises(InputError, match="a Pareto front"):
        load_plan(front)


def test_schema_rejects_unknown_fields_and_wrong_types(plans):
    validator = jsonschema.Draft202012Validator(SCHEMA)
    document = json.loads(plans["1f1b"].read_text())
    for change in (
        lambda d: d.update(extra=1),
        lambda d: d["stages"][0].update(peak_bytes=1.5),
        lambda d: d["config"].update(schedule="zigzag"),
        lambda d: d["exports"]["megatron"].update(extra=1),
        lambda d: d.pop("training"),
    ):
        bad = copy.deepcopy(document)
        change(bad)
        assert not validator.is_valid(bad)


# -- load_plan: the typed view and one-line errors ---------------------------------------------


@pytest.mark.slow  # reads a SEARCHED plan
def test_plan_file_view(plans):
    selective = load_plan(plans["selective"])
    assert selective.config.recompute == "selective" and selective.recomputed_layers
    assert set(selective.recomputed_layers) <= {n for s in selective.stages for n in s.layers}
    assert selective.training.weight_bytes_per_param == 2 and selective.training.global_batch == 32
    assert selective.global_batch == 32 and selective.group_of_stage is None
    assert selective.graph.path == GPT and selective.graph.num_layers == 26
    assert set(selective.exports) == {"torch_pipelining", "megatron", "deepspeed", "torchtitan"}
    placed = load_plan(plans["heterogeneous"])
    assert placed.cluster.is_heterogeneous and len(placed.group_of_stage) == placed.config.pp
    interleaved = load_plan(plans["interleaved"])
    assert interleaved.config.virtual_stages == 2
    assert [len(names) for names in interleaved.virtual_stage_layers] == [
        interleaved.stage_of_layer.count(j) for j in range(8)
    ]
    calibrated = load_plan(plans["calibrated"])
    assert calibrated.calibration.constant_bytes == 123_456_789
    assert calibrated.training.calibration == calibrated.calibration
    full = load_plan(plans["full-zero-throughput"])
    assert (full.runtime, full.training.grad_bytes_per_param) == ("torch", 4)
    plain = load_plan(plans["1f1b"])  # the megatron runtime's bytes: fp32 gradients
    assert (plain.runtime, plain.training.grad_bytes_per_param) == ("megatron", 4)
    assert plain.training.deallocate_pipeline_outputs
    assert not load_plan(plans["interleaved-outputs-kept"]).training.deallocate_pipeline_outputs


@pytest.mark.slow  # reads a SEARCHED plan
def test_a_version_2_plan_without_deallocate_pipeline_outputs_means_true(plans, tmp_path, capsys):
    """Plans written before the field existed: the sent outputs were freed (as Megatron-LM
    does), and solver.evaluate --plan reproduces them."""
    document = json.loads(plans["1f1b"].read_text())
    assert document["training"].pop("deallocate_pipeline_outputs") is True
    path = tmp_path / "older.json"
    path.write_text(json.dumps(document))
    assert load_plan(path).training.deallocate_pipeline_outputs is True
    assert _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)[0] == 0
    kept = json.loads(plans["interleaved-outputs-kept"].read_text())
    assert kept["training"]["deallocate_pipeline_outputs"] is False
    kept["training"].pop("deallocate_pipeline_outputs")  # now read as True: other buffers
    path.write_text(json.dumps(kept))
    code, _, err = _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)
    assert code == 6 and "buffers" in err


def test_a_plan_without_sequence_parallel_fields_means_off(plans, tmp_path, capsys):
    """config.sp and training.sequence_parallel are absent from plans written before them: no
    sequence parallelism; a plan with it records both and reproduces."""
    document = json.loads(plans["1f1b"].read_text())
    assert document["config"].pop("sp") is False
    assert document["training"].pop("sequence_parallel") == "off"
    path = tmp_path / "older.json"
    path.write_text(json.dumps(document))
    older = load_plan(path)
    assert not older.config.sp and older.training.sequence_parallel == "off"
    assert _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)[0] == 0
    split = json.loads(plans["sequence-parallel"].read_text())
    assert split["config"]["sp"] is True and split["training"]["sequence_parallel"] == "on"
    assert "--sequence-parallel" in split["exports"]["megatron"]["args"]
    assert split["exports"]["torch_pipelining"]["tensor_parallel"]["sequence_parallel"] is True
    split["config"].pop("sp")  # read as off, against the training options' "on"
    path.write_text(json.dumps(split))
    code, _, err = _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)
    assert code == 2 and "training.sequence_parallel 'on' gives sp True" in err
    split["training"].pop("sequence_parallel")  # both off: the activations and buffers grow
    path.write_text(json.dumps(split))
    code, _, err = _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)
    assert code == 6 and "activations" in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["stages"][1].update(peak_bytes=1.5),
            "stages[1].peak_bytes: expected an integer, got 1.5; re-create the plan with "
            "python -m solver.plan",
        ),
        (lambda d: d["stages"][0].pop("breakdown"), "stages[0]: missing field breakdown"),
        (lambda d: d.update(colour="red"), "(top level): unknown field colour; remove it"),
        (lambda d: d["config"].update(zero=5), "config.zero: expected one of 0, 1, 2, 3, got 5"),
        (lambda d: d.update(format="layer-graph"), "not a plan"),
        (lambda d: d.update(version=3), "version: 3 is not a version this reader knows"),
        (lambda d: d["stages"].pop(), "stages: 3 stages for pp=4 (config.pp)"),
        (lambda d: d["stages"][2].update(index=5), "stages[2].index: 5, expected 2"),
        (lambda d: d["stage_of_layer"].__setitem__(0, 1), "layers on (virtual) stage 0"),
        (
            lambda d: d["stages"][0]["breakdown"].update(weights=0),
            "stages[0].peak_bytes: ",
        ),
        (lambda d: d["stages"][0]["recomputed"].append("head"), "'head' is not one of"),
        (lambda d: d["graph"].update(sha256="x"), "graph.sha256: "),
        (lambda d: d["training"].update(global_batch=0), "training.global_batch: expected >= 1"),
        (lambda d: d["cluster"].pop("gpu_flops"), "cluster: missing field gpu_flops"),
    ],
)
def test_load_plan_errors_are_one_line(plans, tmp_path, change, message):
    document = json.loads(plans["1f1b"].read_text())
    assert document["config"]["pp"] == 4
    change(document)
    path = tmp_path / "PLAN.json"
    path.write_text(json.dumps(document))
    with pytest.raises(InputError) as raised:
        load_plan(path)
    text = str(raised.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


@pytest.mark.slow  # reads a SEARCHED plan
def test_interleaved_chunks_must_list_the_stage_layers(plans):
    document = json.loads(plans["interleaved"].read_text())
    document["stages"][1]["chunks"].reverse()
    with pytest.raises(InputError, match=r"stages\[1\].chunks: must list its layers in order"):
        load_plan(document)


def test_a_version_1_plan_is_read_but_not_evaluated_again(plans):
    document = json.loads(plans["1f1b"].read_text())
    document["version"] = 1
    for key in ("graph", "training", "memory_objective"):
        del document[key]
    for key in ("gpu_flops", "flops_efficiency", "intra_node_gb_per_s", "inter_node_gb_per_s"):
        del document["cluster"][key]
    plan = load_plan(document)
    assert plan.cluster is None and plan.training is None and plan.graph is None
    assert plan.config.pp == 4 and plan.runtime == "megatron"
    with pytest.raises(InputError, match="version-1 plan records neither"):
        evaluate_plan(plan)


def test_the_writer_refuses_a_plan_its_reader_rejects(plans):
    document = json.loads(plans["1f1b"].read_text())
    checked(copy.deepcopy(document))
    document["stages"][0]["peak_bytes"] += 1
    with pytest.raises(AssertionError, match="fails its reader"):
        checked(document)


# -- evaluate --plan ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", slow_params(KINDS, *SEARCHED))
def test_evaluate_plan_reproduces_peaks_and_times(plans, kind, tmp_path, capsys):
    out = tmp_path / "again.json"
    code, text, err = _run(evaluate_main, ["--plan", str(plans[kind]), "--json", str(out)], capsys)
    assert code == 0, err
    assert "plan check: every stage's peak, breakdown and time equal" in text
    plan, again = json.loads(plans[kind].read_text()), json.loads(out.read_text())
    for key in ("config", "stage_of_layer", "peak_bytes", "iteration_ms", "throughput"):
        assert again[key] == plan[key], key
    for ours, theirs in zip(again["stages"], plan["stages"], strict=True):
        for key in ("peak_bytes", "breakdown", "time_ms", "recomputed", "layers"):
            assert ours[key] == theirs[key], (kind, key)
    assert again["graph"] == plan["graph"] and again["training"] == plan["training"]
    assert plan_differences(load_plan(plans[kind]), evaluate_plan(plans[kind])) == []


def test_evaluate_plan_finds_the_graph_beside_the_plan(plans, tmp_path, capsys):
    document = json.loads(plans["1f1b"].read_text())
    load_graph(GPT).save(tmp_path / "graph.json")
    document["graph"]["path"] = "graph.json"  # relative: not in the working directory
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    assert _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)[0] == 0
    document["graph"]["path"] = None
    path.write_text(json.dumps(document))
    code, _, err = _run(evaluate_main, ["--plan", str(path)], capsys)
    assert code == 2 and "graph.path is null" in err and err.count("\n") == 1
    assert _run(evaluate_main, ["--plan", str(path), GPT, "--quiet"], capsys)[0] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([T5], "is not the graph the plan was made for"),
        (["--pp", "2"], "drop --pp"),
        (["--split", "even", "--recompute", "full"], "drop --recompute, --split"),
    ],
)
def test_evaluate_plan_errors(plans, capsys, extra, message):
    code, _, err = _run(evaluate_main, ["--plan", str(plans["1f1b"]), *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_evaluate_plan_reports_numbers_that_changed(plans, tmp_path, capsys):
    document = json.loads(plans["1f1b"].read_text())
    for stage in document["stages"]:  # as if the cost model had counted one more weight byte
        stage["breakdown"]["weights"] += 1
        stage["peak_bytes"] += 1
    document["peak_bytes"] += 1
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(document))
    code, _, err = _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)
    assert code == 6 and "8 number(s) differ from the plan's" in err
    assert "stages[0].peak_bytes: plan" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("edit", "code", "message"),
    [
        (lambda d: d.update(fits=False), 2, "fits: false, but every stage's peak_bytes is within"),
        (
            lambda d: d["stages"][1].update(usable_bytes=1),
            2,
            "fits: true, but stages[1].peak_bytes ",
        ),
        (
            lambda d: (d.update(fits=False), d["stages"][1].update(usable_bytes=1)),
            6,
            "2 number(s) differ from the plan's (fits: plan false, now true; stages[1].usable",
        ),
        (lambda d: d.update(throughput=1e9), 6, "(throughput: plan 1000000000.0, now "),
        (lambda d: d["stages"][0].update(peak_moment="optimizer step"), 6, "peak_moment: plan"),
        (lambda d: d.update(version=2.0), 2, "version: 2.0 is not a version this reader knows"),
        (lambda d: d.update(version=True), 2, "version: true is not a version this reader knows"),
        (lambda d: d.update(version=1), 2, "version: 1, but the document holds the graph and"),
    ],
    ids=["fits", "usable", "fits-and-usable", "throughput", "moment", "v2.0", "vtrue", "v1"],
)
def test_an_edited_derived_field_or_version_is_not_accepted(
    plans, tmp_path, capsys, edit, code, message
):
    """A plan is the user's file, the recomputation the truth: fits (or another number derived
    from the stages) that disagrees with the file's own stages is a bad file (exit 2); one that
    agrees with them but not with the recomputation is a stale plan (exit 6); a version must be
    an integer this reader knows, and version 1 never wrote the graph record."""
    document = json.loads(plans["1f1b"].read_text())
    edit(document)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    result, out, err = _run(evaluate_main, ["--plan", str(path), "--quiet"], capsys)
    assert result == code and message in err, err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and out == ""


def test_evaluate_without_plan_still_requires_the_split_flags(capsys):
    code, _, err = _run(evaluate_main, [GPT, "--global-batch", "8"], capsys)
    assert code == 2 and "required: --pp, --split" in err and err.count("\n") == 1


# -- evaluate(): training options that contradict the config -----------------------------------

CONFIG = ParallelConfig(pp=2, tp=1, dp=2, micro_batch=2, num_microbatches=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "gpipe"}, "config.schedule '1f1b' not in training.schedule 'gpipe'"),
        ({"virtual_stages": (2,)}, "config.virtual_stages 1 not in training.virtual_stages [2]"),
        ({"recompute": "full"}, "training.recompute 'full' != config.recompute 'none'"),
        ({"micro_batch_sizes": (1,)}, "config.micro_batch 2 not in training.micro_batch_sizes"),
        ({"zero_stages": (1, 2)}, "config.zero 0 not in training.zero_stages [1, 2]"),
        ({"pp": 4}, "training.pp 4 != config.pp 2"),
        ({"global_batch": 8}, "training.global_batch 8 != config dp(2) * micro_batch(2)"),
    ],
)
def test_evaluate_rejects_training_that_contradicts_the_config(options, message):
    graph = load_graph(GPT)
    training = TrainingConfig(**({"global_batch": 16} | options))
    with pytest.raises(InputError, match="training options contradict the config") as raised:
        evaluate(graph, CONFIG, "even", training=training)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_evaluate_accepts_training_that_admits_the_config():
    graph = load_graph(GPT)
    derived = evaluate(graph, CONFIG, "even")
    for options in (
        {},  # the default candidate lists restrict nothing
        {"recompute": "auto", "micro_batch_sizes": (1, 2, 4), "zero_stages": (0, 1)},
        {"pp": 2, "dp": 2, "virtual_stages": (1, 2)},
        {"schedule": "gpipe,1f1b"},  # a searched list or auto admits its members
        {"schedule": "auto"},
    ):
        training = TrainingConfig(global_batch=16, **options)
        result = evaluate(graph, CONFIG, "even", training=training)
        assert [s.peak_bytes for s in result.stages] == [s.peak_bytes for s in derived.stages]
    gpipe = ParallelConfig(**(CONFIG.to_dict() | {"schedule": "gpipe"}))
    with pytest.raises(InputError, match="config.schedule 'gpipe' not in training.schedule '1f1b'"):
        evaluate(graph, gpipe, "even", training=TrainingConfig(global_batch=16))
    assert evaluate(graph, gpipe, "even").training.schedule == "gpipe"  # derived


def test_parallel_config_checks_its_fields():
    with pytest.raises(InputError, match="recompute must be one of none, full, selective"):
        ParallelConfig(**(CONFIG.to_dict() | {"recompute": "auto"}))
    with pytest.raises(InputError, match="interleaved pipelines run 1F1B"):
        ParallelConfig(**(CONFIG.to_dict() | {"schedule": "gpipe", "virtual_stages": 2}))
    with pytest.raises(InputError, match="zero must be one of 0..3"):
        ParallelConfig(**(CONFIG.to_dict() | {"zero": 4}))
