"""torch's split-backward schedules (zbv, dualpipev, interleaved-zb) through solver.evaluate: the
CLI's per-rank peaks are the cost model's (the largest action of each rank's replay), the V puts
the embedding's and the head's chunks on rank 0, the plan JSON records the schedule and evaluates
back to the same peaks. The planner and the sweeps search them (tests/test_zero_bubble_search.py
for the backends)."""

from __future__ import annotations

import json

import pytest

from solver.cli import evaluate_main, plan_main, sweep_main
from solver.costs import layer_costs, rank_memory, stage_costs
from solver.costs.schedule_time import MAX_SCHEDULE_ACTIONS, check_schedule_size, schedule_size
from solver.errors import InputError
from solver.evaluation import default_training
from solver.files.plan_file import evaluate_plan, load_plan
from solver.search.planner import plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B

GIB = 2**30
COMMON = ["--global-batch", "16", "--micro-batch", "1", "--gpus-per-node", "8"]


def _evaluate(run_cli, tmp_path, schedule: str, *extra: str):
    """solver.evaluate on gpt-1.3b, pp 4, v 2, 16 micro-batches, even split: (code, stderr,
    the --json document, its path)."""
    out = tmp_path / f"{schedule}.json"
    argv = [GPT_1_3B, "--pp", "4", "--virtual-stages", "2", "--schedule", schedule, *COMMON]
    code, _, err = run_cli(evaluate_main, *argv, "--split", "even", "--json", str(out), *extra)
    document = json.loads(out.read_text()) if out.exists() else None
    return code, err, document, out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_evaluate_reports_the_replayed_peaks(run_cli, tmp_path, gpt_graph, schedule):
    code, err, document, out = _evaluate(run_cli, tmp_path, schedule, "--runtime", "torch")
    assert (code, err) == (0, "")
    assert document["config"]["schedule"] == schedule
    assert document["config"]["virtual_stages"] == 2
    config = load_plan(str(out)).config
    training = TrainingConfig(
        global_batch=16, schedule=schedule, virtual_stages=(2,), runtime="torch"
    )
    costs = layer_costs(gpt_graph, config, Cluster(num_gpus=4, gpus_per_node=8), training)
    split = document["stage_of_layer"]
    replay = [memory.peak_bytes for memory in rank_memory(costs, split)]
    peaks = [stage["peak_bytes"] for stage in document["stages"]]
    assert peaks == replay == [stage.peak_bytes for stage in stage_costs(costs, split)]
    assert all(peak > 0 for peak in peaks) and document["peak_bytes"] == max(peaks)
    first, last = document["stages"][0]["chunks"][0][0], document["stages"][0]["chunks"][1][-1]
    if schedule == "interleaved-zb":  # the loop placement: the head on the last rank
        assert (first, document["stages"][-1]["chunks"][1][-1]) == ("embed", "head")
    else:
        assert (first, last) == ("embed", "head")  # the V: rank 0 runs stages 0 and 2p - 1


def test_zbv_rank_0_holds_the_embedding_and_the_head(run_cli, tmp_path):
    """ZBV on gpt-1.3b: rank 0 runs virtual stages 0 and 7 (embedding, head); it has the largest
    peak; the JSON round trip (load_plan, evaluate_plan, --plan) gives the same peaks."""
    code, err, document, out = _evaluate(run_cli, tmp_path, "zbv")
    assert (code, err) == (0, "")
    stages = document["stages"]
    assert stages[0]["chunks"][0][0] == "embed" and stages[0]["chunks"][1][-1] == "head"
    assert [len(stage["chunks"]) for stage in stages] == [2] * 4
    peaks = [stage["peak_bytes"] for stage in stages]
    assert peaks[0] == max(peaks) > min(peaks) > 0
    order = [0, 1, 2, 3, 3, 2, 1, 0]  # the rank of each virtual stage in a V
    for j, rank in enumerate(order):
        chunk = stages[rank]["chunks"][0 if j < 4 else 1]
        positions = [i for i, s in enumerate(document["stage_of_layer"]) if s == j]
        assert len(chunk) == len(positions) > 0
    loaded = load_plan(str(out))
    assert loaded.config.schedule == "zbv"
    assert loaded.virtual_stage_layers[0][0] == "embed"
    assert loaded.virtual_stage_layers[7][-1] == "head"
    again = evaluate_plan(loaded, GPT_1_3B)
    assert [stage.peak_bytes for stage in again.stages] == peaks
    code, text, err = run_cli(evaluate_main, "--plan", str(out), GPT_1_3B)
    assert (code, err) == (0, "") and "zbv" in text


@pytest.mark.slow
def test_plot_schedule_draws_the_split_steps(run_cli, tmp_path):
    picture = tmp_path / "zbv.png"
    code, err, _, _ = _evaluate(run_cli, tmp_path, "zbv", "--plot-schedule", str(picture))
    assert (code, err) == (0, "")
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--virtual-stages", "1"], "schedule zbv places exactly 2 chunks per rank in a V"),
        (["--memory-model", "empirical"], "--schedule zbv: the empirical statistics describe"),
    ],
)
def test_evaluate_refusals_are_one_line(run_cli, tmp_path, extra, message):
    out = tmp_path / "e.json"
    argv = [GPT_1_3B, "--pp", "4", "--schedule", "zbv", *COMMON, "--split", "even"]
    if "--virtual-stages" not in extra:
        argv += ["--virtual-stages", "2"]
    code, _, err = run_cli(evaluate_main, *argv, *extra, "--json", str(out))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_plan_searches_the_split_schedules(run_cli, tmp_path, schedule):
    """A pinned split schedule is planned and proven (the smallest peak; under a --max-slowdown
    budget the simulated time may overrun the looser bound of these schedules and the plan is
    honestly FEASIBLE); the plan's peak is the replay's (evaluate_plan recomputes it)."""
    out = tmp_path / "plan.json"
    argv = [GPT_1_3B, "--gpus", "4", "--pp", "4", "--schedule", schedule, "--runtime", "torch"]
    argv += ["--max-slowdown", "none"]
    code, _, err = run_cli(plan_main, *argv, "--virtual-stages", "2", *COMMON, "--json", str(out))
    assert (code, err) == (0, "")
    document = json.loads(out.read_text())
    assert document["config"]["schedule"] == schedule
    assert document["solver"]["status"] == "OPTIMAL"
    again = evaluate_plan(load_plan(str(out)), GPT_1_3B)
    assert again.peak_bytes == document["peak_bytes"] > 0


@pytest.mark.parametrize(
    ("schedule", "extra", "message"),
    [
        ("zbv", [], "error: schedule zbv places exactly 2 chunks per rank in a V"),
        ("dualpipev", ["--virtual-stages", "2", "--global-batch", "4"], "m = 4 < 2 pp = 8"),
        (
            "1f1b,zb",
            [],
            "error: schedule must be one of 1f1b, gpipe, interleaved-zb, zbv, dualpipev, a comma",
        ),
        ("zbv", ["--memory-model", "empirical"], "the empirical statistics describe 1F1B"),
    ],
)
def test_plan_refuses_a_pinned_schedule_in_one_line(run_cli, tmp_path, schedule, extra, message):
    """Only when the single pinned schedule has no (pp, v, m) it runs: torch's own rule."""
    out = tmp_path / "plan.json"
    argv = [GPT_1_3B, "--gpus", "4", "--pp", "4", "--schedule", schedule, *COMMON, *extra]
    code, _, err = run_cli(plan_main, *argv, "--json", str(out))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not out.exists()


@pytest.mark.slow
def test_sweep_takes_the_split_schedules(run_cli, tmp_path):
    out = tmp_path / "rows.csv"
    argv = [GPT_1_3B, "--gpus", "4", "--gpu-memory", "80GB", "--schedule", "zbv", "--pp", "4"]
    argv += ["--time-limit", "5"]  # unproven at the default 60 s too (33 s): the same zbv row
    code, _, err = run_cli(
        sweep_main, *argv, "--virtual-stages", "2", "--global-batch", "16", "--out", str(out)
    )
    assert (code, err) == (0, "")
    assert "zbv" in out.read_text()


@pytest.mark.slow
def test_api_auto_is_never_worse_than_each_schedule(gpt_graph):
    """--schedule auto searches every schedule beside the other decisions: its smallest peak is
    the least of the pinned searches' (and the schedule it names is one of them)."""
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=80 * GIB)
    base = dict(global_batch=16, pp=4, micro_batch_sizes=(1,), max_slowdown=None)
    base |= dict(virtual_stages=(1, 2), runtime="torch")
    peaks = {}
    for schedule in ("1f1b", "zbv", "dualpipev", "interleaved-zb"):
        peaks[schedule] = plan(gpt_graph, cluster, TrainingConfig(schedule=schedule, **base))
    both = plan(gpt_graph, cluster, TrainingConfig(schedule="auto", **base))
    assert both.peak_bytes == min(found.peak_bytes for found in peaks.values())
    assert peaks[both.config.schedule].peak_bytes == both.peak_bytes


def test_auto_out_of_time_for_the_split_schedules_keeps_the_others_optimum(gpt_graph, monkeypatch):
    """Bounding the split-backward configs gets a share of the time left after the others: when
    it runs out (here at once), auto still returns the 1F1B optimum, unproven, its gap
    unbounded, and says which configs it did not reach."""
    from solver.search import config_search

    monkeypatch.setattr(config_search, "SPLIT_BOUNDING_SHARE", 0.0)
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=80 * GIB)
    base = dict(global_batch=16, pp=4, micro_batch_sizes=(1,), max_slowdown=None)
    base |= dict(virtual_stages=(1, 2), runtime="torch")  # zbv's two chunks per rank
    alone = plan(gpt_graph, cluster, TrainingConfig(schedule="1f1b", **base), time_limit_s=600)
    both = plan(gpt_graph, cluster, TrainingConfig(schedule="1f1b,zbv", **base), time_limit_s=600)
    assert alone.solver.status == "OPTIMAL"
    assert (both.peak_bytes, both.config) == (alone.peak_bytes, alone.config)
    assert (both.solver.status, both.solver.bound) == ("FEASIBLE", 0.0)
    (note,) = [n for n in both.solver.notes if "neither bounded nor searched" in n]
    assert "zbv" in note and "raise --time-limit" in note
    # with the share back, this small case bounds every config
    monkeypatch.setattr(config_search, "SPLIT_BOUNDING_SHARE", 0.5)
    again = plan(gpt_graph, cluster, TrainingConfig(schedule="1f1b,zbv", **base), time_limit_s=600)
    assert not any("neither bounded" in n for n in again.solver.notes)


def test_api_takes_the_names_and_evaluate_takes_them():
    with pytest.raises(InputError, match="schedule must be one of 1f1b, gpipe"):
        TrainingConfig(global_batch=16, schedule="zbv,,x")
    assert TrainingConfig(global_batch=16, schedule="auto").schedules == (
        "1f1b",
        "gpipe",
        "interleaved-zb",
        "zbv",
        "dualpipev",
    )
    assert TrainingConfig(global_batch=16, schedule="zbv, 1f1b").schedules == ("zbv", "1f1b")
    config = ParallelConfig(
        pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=16, schedule="zbv", virtual_stages=2
    )
    assert default_training(config).schedule == "zbv"
    assert config.label() == "pp4 tp1 dp1 b1 m16 zero0 zbv v2"


def test_split_schedules_count_three_actions_per_micro_batch_and_chunk():
    assert schedule_size(4, 2, 16) == 2 * 4 * 2 * 16
    for schedule in ("zbv", "dualpipev", "interleaved-zb"):
        assert schedule_size(4, 2, 16, schedule) == 3 * 4 * 2 * 16
    m = MAX_SCHEDULE_ACTIONS // (2 * 4 * 2)  # fits 1F1B's 2 actions, not F, I and W
    check_schedule_size(4, 2, m)
    with pytest.raises(InputError, match=r"x 3 x .* forward, input- and weight-gradient steps"):
        check_schedule_size(4, 2, m, 1, "zbv")
