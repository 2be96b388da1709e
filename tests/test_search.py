"""Config search: lower bounds are valid (pruning never skips the optimum), time limits are
reported honestly, candidate configs follow the rules."""

from __future__ import annotations

import random

import pytest

from solver import Cluster, TrainingConfig
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, StageProblem
from solver.errors import InputError, NoSolutionError
from solver.search.candidates import candidate_configs, memory_lower_bound, time_lower_bound
from solver.search.config_search import Deadline, build_entries, search
from solver.search.planner import plan
from tests.random_graphs import random_chain, random_dag, random_problem


@pytest.mark.parametrize("seed", range(40))
def test_lower_bounds_never_exceed_the_optimum(seed):
    rng = random.Random(300 + seed)
    graph = (random_chain if seed % 2 else random_dag)(rng, rng.randint(3, 6))
    problem = random_problem(rng, graph)
    best_peak = solve_brute_force(problem).objective
    fastest = solve_brute_force(StageProblem(costs=problem.costs, objective=OBJECTIVE_TIME))
    assert memory_lower_bound(problem.costs) <= best_peak
    assert time_lower_bound(problem.costs) <= fastest.objective


def test_candidate_configs_follow_the_rules():
    cluster = Cluster(num_gpus=16, gpus_per_node=4)
    training = TrainingConfig(global_batch=32, micro_batch_sizes=(1, 4), zero_stages=(0, 3))
    configs = candidate_configs(6, cluster, training)
    assert configs, "some config must exist"
    for config in configs:
        assert config.pp * config.tp * config.dp == 16
        assert 4 % config.tp == 0 and config.pp <= 6
        assert config.dp * config.micro_batch * config.num_microbatches == 32
        assert config.dp > 1 or config.zero == 0
    assert {c.pp for c in configs} == {1, 2, 4}
    assert {c.tp for c in configs} == {1, 2, 4}
    assert len(configs) == len(set(configs))
    pinned = candidate_configs(6, cluster, TrainingConfig(global_batch=32, pp=2, tp=4))
    assert {(c.pp, c.tp, c.dp) for c in pinned} == {(2, 4, 2)}
    with pytest.raises(InputError, match=r"tp\(3\) does not divide"):
        candidate_configs(6, Cluster(num_gpus=12), TrainingConfig(global_batch=12, tp=3))


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_candidate_configs_with_each_sequence_parallel_mode(mode):
    """off: no candidate has sp; on and auto: exactly those with tp > 1 (the same layouts as
    off, so a search can only get lower peaks); on refuses a pinned tp of 1, auto does not."""
    cluster = Cluster(num_gpus=16, gpus_per_node=4)
    plain = candidate_configs(6, cluster, TrainingConfig(global_batch=32))
    configs = candidate_configs(6, cluster, TrainingConfig(global_batch=32, sequence_parallel=mode))
    assert [c.sp for c in configs] == [mode != "off" and c.tp > 1 for c in configs]
    assert [(c.pp, c.tp, c.dp, c.micro_batch, c.zero) for c in configs] == [
        (c.pp, c.tp, c.dp, c.micro_batch, c.zero) for c in plain
    ]
    pinned = dict(global_batch=32, tp=1, sequence_parallel=mode)
    if mode == "on":
        with pytest.raises(InputError, match=r"--sequence-parallel on with pinned tp\(1\)"):
            TrainingConfig(**pinned)
    else:
        assert not any(c.sp for c in candidate_configs(6, cluster, TrainingConfig(**pinned)))


def test_sequence_parallelism_never_raises_a_planned_peak():
    rng = random.Random(7)
    graph = random_chain(rng, 8)
    cluster = Cluster(num_gpus=8, gpu_memory_bytes=2**40)
    peaks = {}
    for mode in ("off", "auto"):
        training = TrainingConfig(global_batch=16, tp=4, sequence_parallel=mode)
        chosen = plan(graph, cluster, training, time_limit_s=30)
        assert chosen.config.sp == (mode == "auto")
        peaks[mode] = chosen.peak_bytes
    assert peaks["auto"] < peaks["off"]


class OneSolveDeadline(Deadline):
    """Expires once the first config is solved: the search must report an unproven result."""

    spent: bool = False

    def remaining(self) -> float:
        return 0.0 if self.spent else 10.0


@pytest.fixture
def one_solve_deadline(monkeypatch) -> OneSolveDeadline:
    """A OneSolveDeadline that the search's first solve spends."""
    import solver.search.config_search

    deadline = OneSolveDeadline(end=0)
    solve = solver.search.config_search.solve

    def solve_and_spend(*args, **kwargs):
        solution = solve(*args, **kwargs)
        deadline.spent = True
        return solution

    monkeypatch.setattr(solver.search.config_search, "solve", solve_and_spend)
    return deadline


def test_time_limit_leaves_configs_open_and_reports_a_gap(one_solve_deadline):
    graph = random_chain(random.Random(1), 8)
    cluster = Cluster(num_gpus=8, gpus_per_node=2)
    entries = build_entries(graph, cluster, TrainingConfig(global_batch=16))
    full = search(
        entries,
        objective=OBJECTIVE_MEMORY,
        capacity_bytes=None,
        iteration_budget_ns=None,
        backend="auto",
        deadline=Deadline.after(60),
    )
    one_solve_deadline.spent = False  # the full search's solves spent it
    cut = search(
        entries,
        objective=OBJECTIVE_MEMORY,
        capacity_bytes=None,
        iteration_budget_ns=None,
        backend="auto",
        deadline=one_solve_deadline,
    )
    assert full.proven and full.bound == full.value
    assert not cut.proven and cut.solved == 1
    assert cut.bound <= full.value <= cut.value  # the bound is still valid


def test_no_plan_before_the_time_limit_is_exit_code_4():
    graph = random_chain(random.Random(2), 6)
    with pytest.raises(NoSolutionError, match="time limit") as caught:
        plan(
            graph,
            Cluster(num_gpus=4, gpus_per_node=2),
            TrainingConfig(global_batch=8),
            time_limit_s=1e-9,
        )
    assert caught.value.exit_code == 4


def test_plan_cut_by_the_time_limit_is_marked_not_proven(monkeypatch, one_solve_deadline):
    from solver.report.plan_report import format_plan, plan_to_dict

    graph = random_chain(random.Random(1), 8)
    monkeypatch.setattr("solver.search.planner.Deadline.after", lambda seconds: one_solve_deadline)
    result = plan(
        graph,
        Cluster(num_gpus=8, gpus_per_node=2),
        TrainingConfig(global_batch=16, max_slowdown=None),
    )
    assert result.solver.status == "FEASIBLE"
    assert result.solver.bound <= result.peak_bytes
    assert "NOT proven optimal" in format_plan(result)
    assert plan_to_dict(result)["solver"]["status"] == "FEASIBLE"
