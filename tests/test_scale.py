"""Large inputs (issue 27, item 2): the chain algorithm's memory linear in layers however many
stages, every other backend bounded or refused with one line, and the time limit honoured from
the first byte of the graph read."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

import solver.backends.chain as chain_module
import solver.backends.prefix_sums as prefix_sums
from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import solve_chain
from solver.backends.cpsat import solve_cpsat
from solver.backends.problem import OBJECTIVE_TIME, OPTIMAL, UNKNOWN, StageProblem
from solver.backends.split_search import TIME, _Limits
from solver.cli import evaluate_main, plan_main
from solver.costs import layer_costs
from solver.deadline import Deadline
from solver.errors import InputError, NoSolutionError
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B, ROOT
from tests.random_graphs import random_chain


def chain_document(num_layers: int) -> dict:
    """A chain of small, unequal layers (parameters, activations, FLOPs vary with the index)."""
    layers = [
        {
            "name": f"l{i}",
            "params": 100 + (i * 7919) % 400,
            "activation_bytes": 1000 + (i * 104729) % 2000,
            "output_bytes": 256,
            "fwd_flops": 1e6 * (1 + i % 3),
        }
        for i in range(num_layers)
    ]
    return {"format": "layer-graph", "version": 1, "model": f"chain-{num_layers}", "layers": layers}


def chain_costs(num_layers: int, pp: int, m: int = 1):
    config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=m)
    graph = graph_from_dict(chain_document(num_layers))
    return layer_costs(graph, config, Cluster(num_gpus=pp), TrainingConfig(global_batch=m))


# -- the chain algorithm: tables O(L) ------------------------------------------------------------


def test_chain_tables_stay_linear_in_layers_on_as_many_stages(monkeypatch):
    """800 layers on 800 stages: the bound's terms were U, V arrays [term, stage, position],
    2 x 8 x 800 x 801 int64 = 82 MB (the issue's 20,002-layer chain asked for 24 GiB); now
    coefficients [term, stage, 3], a few prefix sums and tables within ``TABLE_BYTES``."""
    monkeypatch.setattr(chain_module, "TABLE_BYTES", 2**20)
    layers = 800
    chain = chain_module._Chain(chain_costs(layers, layers, m=layers), None)
    rules = chain.stage_rules(_Limits(kind=TIME, cap_bytes=2**40, budget_ns=2**50))
    sums = {id(s): s for stage in rules for end, start, _, _ in stage for s in (end, start)}
    tables = sum(s.nbytes for s in sums.values() if isinstance(s, np.ndarray))
    lazy = [s for s in sums.values() if isinstance(s, prefix_sums.PrefixSums)]
    arrays = sum(value.nbytes for value in vars(chain).values() if isinstance(value, np.ndarray))
    assert len(lazy) > 500 and tables <= 2**20  # most sums evaluated where read
    assert arrays < 2**20, arrays  # prefix sums, log L range-max rows, [term, stage, 3]
    ok, ends = chain.reach_forward(_Limits(kind=TIME), np.array([2**50]))
    assert ok[0] and ends[:, 0].tolist() == list(range(layers))


@pytest.mark.slow
def test_chain_on_as_many_stages_as_layers_solves_in_megabytes():
    costs = chain_costs(1500, 1500)
    tracemalloc.start()
    solution = solve_chain(StageProblem(costs=costs, objective=OBJECTIVE_TIME), time_limit_s=60)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert solution.status == OPTIMAL
    assert solution.stage_of_layer == list(range(1500))  # the only split
    assert peak < 40 * 2**20, f"{peak / 2**20:.0f} MiB traced"


@pytest.mark.parametrize("seed", range(3))
def test_untabled_sums_give_the_tabled_optimum(monkeypatch, seed):
    """With no table at all (every U, V evaluated where read) and a one-position window before
    the bisection, the chain algorithm returns the same optimum and split, memory and time
    objectives, with and without limits."""
    rng = random.Random(seed)
    problems = []
    for _ in range(3):
        layers = rng.randint(6, 24)
        pp = rng.randint(2, min(layers, 6))
        m = rng.choice([pp, 2 * pp])
        config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=m)
        costs = layer_costs(
            random_chain(rng, layers), config, Cluster(num_gpus=pp), TrainingConfig(global_batch=m)
        )
        free = solve_chain(StageProblem(costs=costs))
        fastest = solve_chain(StageProblem(costs=costs, objective=OBJECTIVE_TIME))
        problems += [
            StageProblem(costs=costs),
            StageProblem(costs=costs, objective=OBJECTIVE_TIME),
            StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=free.objective),
            StageProblem(costs=costs, iteration_budget_ns=fastest.objective * 11 // 10),
        ]
    tabled = [solve_chain(problem) for problem in problems]
    monkeypatch.setattr(chain_module, "TABLE_BYTES", 0)
    monkeypatch.setattr(prefix_sums, "SLICED_WINDOW", 1)
    monkeypatch.setattr(chain_module, "DP_CHUNK_PAIRS", 7)
    for problem, expected in zip(problems, tabled, strict=True):
        found = solve_chain(problem)
        assert (found.status, found.objective, found.stage_of_layer) == (
            expected.status,
            expected.objective,
            expected.stage_of_layer,
        )


def test_prefix_sums_search_matches_numpy_in_every_window():
    rng = np.random.default_rng(4)
    basis = np.concatenate(([0], np.cumsum(rng.integers(1, 5, 300))))
    other = np.concatenate(([0], np.cumsum(rng.integers(0, 4, 300))))
    lazy = prefix_sums.PrefixSums(((3, basis), (-1, other)), 300)  # 3 b - o, non-decreasing
    table = 3 * basis - other
    assert np.all(np.diff(table) >= 0)
    values = rng.integers(-5, int(table[-1]) + 5, 200)
    low = rng.integers(0, 150, 200)
    high = low + rng.integers(0, 152, 200)
    assert np.array_equal(lazy.table(), table) and np.array_equal(lazy[low], table[low])
    for side in ("left", "right"):
        expected = np.clip(np.searchsorted(table, values, side), low, high)
        assert np.array_equal(lazy.searchsorted(values, side, low, high), expected)
        assert np.array_equal(lazy._bisect(values, side, low, high), expected)
        found = prefix_sums.search(table, values, side, low, high)  # a table's, unclipped
        assert np.array_equal(np.clip(found, low, high), expected)


# -- the other backends: bounded, or refused in one line ---------------------------------------


def test_brute_force_refuses_an_enumeration_past_its_limit():
    costs = chain_costs(40, 4)
    with pytest.raises(InputError, match=r"brute force: 4\^40 stage assignments .* solve_chain"):
        solve_brute_force(StageProblem(costs=costs))


def test_cpsat_model_past_the_cap_is_not_built_and_the_hint_stands(monkeypatch):
    import solver.backends.formulation as formulation

    monkeypatch.setattr(formulation, "MAX_FORMULATION_CELLS", 10)
    costs = chain_costs(12, 3)
    hint = [0] * 4 + [1] * 4 + [2] * 4
    started = time.perf_counter()
    solution = solve_cpsat(StageProblem(costs=costs), time_limit_s=30, hint=hint)
    assert time.perf_counter() - started < 1.0
    assert solution.stage_of_layer == hint and solution.status != OPTIMAL
    without = solve_cpsat(StageProblem(costs=costs), time_limit_s=30)
    assert without.status == UNKNOWN and without.stage_of_layer is None


def test_explicit_cpsat_where_no_model_fits_is_one_line_naming_the_chain(
    monkeypatch, run_cli, tmp_path
):
    import solver.search.config_search as config_search

    monkeypatch.setattr(config_search, "MAX_FORMULATION_CELLS", 10)
    monkeypatch.setattr(config_search, "formulation_fits", lambda layers, stages: False)
    args = ("--gpus", "2", "--global-batch", "8", "--backend", "cpsat", "--time-limit", "30")
    code, out, err = run_cli(plan_main, GPT_1_3B, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --backend cpsat: every candidate")
    assert "use --backend chain" in err and "coarser graph" in err
    assert list(tmp_path.iterdir()) == []


def test_evaluate_refuses_a_schedule_too_long_to_simulate(run_cli):
    """pp 2 with 2^20 micro-batches: 4 x 2^20 forwards and backwards (about 1.5 GB and 30 s to
    simulate) are refused before any, naming the micro-batch that would do."""
    args = ("--gpus", "2", "--pp", "2", "--global-batch", str(2**20), "--split", "even")
    code, out, err = run_cli(evaluate_main, GPT_1_3B, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "too long to simulate" in err
    assert "--micro-batch of at least 4" in err


def test_plan_leaves_out_configs_whose_schedule_is_too_long(monkeypatch, run_cli):
    import solver.costs.schedule_time as schedule_time
    import solver.search.candidates as candidates
    import solver.search.planner as planner

    for module in (schedule_time, candidates, planner):
        monkeypatch.setattr(module, "MAX_SCHEDULE_ACTIONS", 40)
    # 2 GPUs, batch 16: pp 2 dp 1 has 2 x 2 x 16 = 64 actions (left out), pp 1 dp 2 has 16
    code, out, err = run_cli(plan_main, GPT_1_3B, "--gpus", "2", "--global-batch", "16")
    assert code == 0, err
    assert "config: pp1 " in out
    assert "note: 1 candidate config not searched (e.g. pp2 tp1 dp1 b1 m16" in out
    # every config too long: one line naming the micro-batch that would do
    args = ("--gpus", "2", "--global-batch", "64", "--micro-batch", "1")
    code, out, err = run_cli(plan_main, GPT_1_3B, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "pp 1 x virtual stages 1 x 2 x 32 micro-batches = 64" in err
    assert "too long to simulate (at most 40" in err and "--micro-batch of at least 2" in err


# -- the time limit from the first byte read ----------------------------------------------------


def test_reading_the_graph_stops_at_the_deadline():
    document = chain_document(10)
    with pytest.raises(NoSolutionError, match="time limit reached while reading the graph <dict>"):
        graph_from_dict(document, deadline=Deadline(end=0.0))
    assert graph_from_dict(document, deadline=Deadline.after(60)).num_layers == 10


def test_schema_checked_in_parts_names_the_item_in_the_whole_document(monkeypatch, write_json):
    import solver.graph as graph_module

    monkeypatch.setattr(graph_module, "SCHEMA_CHUNK", 4)
    document = chain_document(11)
    document["layers"][9]["params"] = -1
    with pytest.raises(InputError, match=r"\$\.layers\[9\]\.params: -1 is less than"):
        graph_module.load_graph(write_json("g.json", document))
    document = chain_document(11)
    document["edges"] = [
        {"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 256 if i != 6 else "x"} for i in range(10)
    ]
    with pytest.raises(InputError, match=r"\$\.edges\[6\]\.bytes: 'x' is not"):
        graph_module.load_graph(write_json("g.json", document))
    document["edges"][6]["bytes"] = 256
    assert graph_module.load_graph(write_json("g.json", document)).num_layers == 11


@pytest.mark.slow
def test_time_limit_holds_on_a_200k_layer_chain(tmp_path):
    """--time-limit 3 on a 200,000-layer chain (19 MB; reading and checking it alone takes about
    8 s here): exit 4 with one line by about 3 s after the command starts, nothing written."""
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(chain_document(200_000)))
    out = tmp_path / "plan.json"
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "solver.plan", str(path), "--gpus", "1", "--global-batch", "8"]
        + ["--time-limit", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    wall = time.perf_counter() - started
    assert run.returncode == 4, run.stderr
    assert run.stderr.count("\n") == 1 and "time limit reached while reading" in run.stderr
    assert wall < 3 + 3.5, wall  # the interpreter's start and imports (~1 s) come first
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["chain.json"]


def _run_measured(command: list[str], folder) -> tuple[int, str, float]:
    """(exit code, stderr, peak resident MiB) of ``command``, the peak its own
    (``os.wait4``): RUSAGE_CHILDREN is the largest of every child the test process waited
    for, another test's included."""
    import os

    with open(folder / "stderr.txt", "w+") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return process.returncode, err.read(), usage.ru_maxrss / 1024


@pytest.mark.slow
def test_20002_layer_chain_on_20002_stages_plans_in_bounded_memory(tmp_path):
    """The issue's crash (numpy asking 23.8 GiB for the bound's [term, stage, position] arrays):
    pp 20,002 pinned, one layer a stage, one micro-batch of 20,002 samples. Exit 0 with the only
    split, or 4 at the limit, in well under a GiB."""
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(chain_document(20_002)))
    args = ["--gpus", "20002", "--pp", "20002", "--global-batch", "20002"]
    args += ["--micro-batch", "20002", "--time-limit", "40", "--quiet"]
    returncode, stderr, peak_mib = _run_measured(
        [sys.executable, "-m", "solver.plan", str(path), *args], tmp_path
    )
    assert returncode in (0, 4), stderr
    assert "Traceback" not in stderr and stderr.count("\n") <= 1
    assert peak_mib < 1500, peak_mib


def test_deadline_checked_loop_reports_progress():
    from solver.deadline import checked

    with pytest.raises(NoSolutionError, match=r"while doing item 0; raise --time-limit"):
        list(checked(range(10), Deadline(end=0.0), lambda n: f"doing item {n}"))
    assert list(checked(range(5), None, str)) == list(range(5))
    assert dataclasses.is_dataclass(Deadline)


@pytest.mark.parametrize("seed", range(4))
def test_as_many_stages_as_layers_gives_the_only_split_as_brute_force(seed):
    """One layer a stage: the chain algorithm returns the only split at once, with the brute
    force's status and objective, memory and time, also when it breaks a limit."""
    rng = random.Random(seed)
    layers = rng.randint(2, 6)
    config = ParallelConfig(pp=layers, tp=1, dp=1, micro_batch=1, num_microbatches=layers)
    costs = layer_costs(
        random_chain(rng, layers),
        config,
        Cluster(num_gpus=layers),
        TrainingConfig(global_batch=layers),
    )
    free = solve_brute_force(StageProblem(costs=costs))
    problems = [
        StageProblem(costs=costs),
        StageProblem(costs=costs, objective=OBJECTIVE_TIME),
        StageProblem(costs=costs, capacity_bytes=free.objective - 1),  # infeasible
        StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=free.objective),
    ]
    for problem in problems:
        found, expected = solve_chain(problem), solve_brute_force(problem)
        assert (found.status, found.objective) == (expected.status, expected.objective)
        if found.objective is not None:
            assert found.stage_of_layer == list(range(layers)) and found.bound == found.objective


def test_planning_stops_at_once_when_the_work_after_the_searches_cannot_fit(monkeypatch):
    """The time kept back for the evaluations, report and exports after the searches is
    measured on the largest config (one stage-cost evaluation of its even split); when it is
    more than the time left, the call ends at once with exit 4's error naming the figures. With
    the time there, the probe changes nothing in the plan."""
    import solver.search.finishing as finishing
    from solver.search.planner import plan

    graph = graph_from_dict(chain_document(40))
    cluster = Cluster(num_gpus=8)
    training = TrainingConfig(global_batch=16, pp=8)
    expected = plan(graph, cluster, training, time_limit_s=60)
    monkeypatch.setattr(finishing, "PROBE_MIN_STAGES", 1)
    same = plan(graph, cluster, training, time_limit_s=60)
    assert same.stage_of_layer == expected.stage_of_layer and same.peak_bytes == expected.peak_bytes
    monkeypatch.setattr(finishing, "FINISH_EVALUATIONS", 1e12)
    with pytest.raises(NoSolutionError, match=r"before searching: on 8 stages one plan's"):
        plan(graph, cluster, training, time_limit_s=60)


@pytest.mark.slow
def test_time_limit_holds_on_20002_stages(tmp_path):
    """--time-limit 5 on 20,002 one-layer stages (one evaluation takes about a second of
    per-stage Python): the searches keep back the time of the work after them, or the run
    stops before searching; either way it ends by the limit plus the interpreter's start."""
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(chain_document(20_002)))
    args = ["--gpus", "20002", "--pp", "20002", "--global-batch", "20002"]
    args += ["--micro-batch", "20002", "--time-limit", "5", "--quiet"]
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "solver.plan", str(path), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    wall = time.perf_counter() - started
    assert run.returncode in (0, 4), run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("\n") <= 1
    assert wall < 5 + 3.5, wall


@pytest.mark.slow
def test_sweep_reads_the_graph_within_its_time_limit(tmp_path):
    """A sweep's --time-limit bounds reading the graph too (a 50,000-layer chain takes about
    2 s to read and check here): exit 4 with one line, no CSV."""
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(chain_document(50_000)))
    out = tmp_path / "rows.csv"
    run = subprocess.run(
        [sys.executable, "-m", "solver.sweep", str(path), "--gpus", "1,2"]
        + ["--gpu-memory", "80GiB", "--global-batch", "8", "--time-limit", "0.05"]
        + ["--quiet", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 4, run.stderr
    assert run.stderr.count("\n") == 1 and "time limit reached while reading" in run.stderr
    assert not out.exists()
