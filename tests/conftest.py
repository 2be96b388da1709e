"""Shared test fixtures, paths and builders (tiers and markers: docs/testing.md).

Fixtures here reach every test file by name. The path constants and the graph and cluster
builders are also needed at import time (``parametrize`` lists, module-level constants), so test
files import them: ``from tests.conftest import GPT_1_3B, gpt_chain``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from solver.costs import LayerCosts, layer_costs
from solver.files.cluster_file import cluster_from_dict
from solver.graph import LayerGraph, graph_from_dict, load_graph
from solver.specs import Cluster, ParallelConfig, TrainingConfig

# Tests never download: hf: names resolve from local paths, bundled configs and the HF cache only
# (huggingface_hub reads this when first imported; subprocesses inherit it). Without it, a name
# that is not cached would be looked up on the Hub, and with no network that retries for ~20 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The tests that press Ctrl-C on a CLI (test_interrupts.py, test_sweep_ray.py) need it to start
# with SIGINT's default action, as from a terminal. pytest started in the background by a shell
# without job control (`pytest ... &` in a script, some CI runners) inherits SIGINT ignored, and
# so would every CLI it starts (Python then installs no KeyboardInterrupt handler): the CLIs
# exited 0 or ran on after Ctrl-C. A handler here is reset to the default by exec in each child.
# (pytest-xdist's workers import this file on their main thread, as pytest does.)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (subprocess tests run the CLIs from it)."""
EXAMPLES = ROOT / "examples"
GPT_1_3B = str(EXAMPLES / "gpt-1.3b.json")
"""The bundled GPT 1.3B chain (26 layers): the usual input of the CLI tests."""
T5_DAG = str(EXAMPLES / "t5-dag.json")
MIXED_CLUSTER = str(EXAMPLES / "clusters" / "a100-40g-80g.json")
"""The bundled two-group cluster file (A100 40 GiB and 80 GiB nodes)."""

# -- small graphs and clusters -------------------------------------------------------------


def gpt_chain(num_blocks: int, *, extra: dict[int, str] | None = None) -> LayerGraph:
    """A toy GPT-shaped chain: embed, b0..b{n-1}, head (layer roles for the engine exports);
    ``extra`` inserts a layer of kind other before block i."""
    layers = [
        {
            "name": "embed",
            "kind": "embedding",
            "params": 10,
            "activation_bytes": 1,
            "output_bytes": 1,
        }
    ]
    for i in range(num_blocks):
        if extra and i in extra:
            layers.append(
                {
                    "name": extra[i],
                    "kind": "other",
                    "params": 1,
                    "activation_bytes": 1,
                    "output_bytes": 1,
                }
            )
        layers.append({"name": f"b{i}", "params": 10, "activation_bytes": 1, "output_bytes": 1})
    layers.append({"name": "head", "params": 10, "activation_bytes": 1, "output_bytes": 1})
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "toy", "layers": layers}
    )


def activation_heavy_chain(num_layers: int) -> LayerGraph:
    """Identical layers whose saved activations dwarf their output (recomputing pays)."""
    layers = [
        {
            "name": f"layers.{i}",
            "params": 1000,
            "activation_bytes": 20000,
            "output_bytes": 500,
            "fwd_flops": 1e9,
        }
        for i in range(num_layers)
    ]
    return graph_from_dict({"format": "layer-graph", "version": 1, "model": "u", "layers": layers})


def cluster_group(
    name: str, memory: int | str, *, nodes: int = 1, gpus: int = 2, tflops: float = 989
) -> dict:
    """One node group of a cluster file (docs/cluster.md): ``nodes`` x ``gpus`` GPUs of
    ``memory`` bytes (or text such as "40GiB") at ``tflops`` (989: H100 bf16 dense)."""
    return {
        "name": name,
        "num_nodes": nodes,
        "gpus_per_node": gpus,
        "gpu_memory": memory,
        "gpu_tflops": tflops,
    }


def cluster_of(*groups: dict) -> Cluster:
    """The cluster of a cluster file with these groups."""
    return cluster_from_dict({"format": "cluster", "version": 1, "groups": list(groups)})


def slow_params(values: Iterable[Any], *slow: Any) -> list[Any]:
    """``values`` for ``parametrize``, those in ``slow`` marked slow (the rest stay fast); a
    tuple value fills several argument names, as in a plain parametrize list."""
    return [
        pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=pytest.mark.slow)
        if value in slow
        else value
        for value in values
    ]


# -- the fast tier ---------------------------------------------------------------------------

FAST_CASES_PER_TEST = 1
"""Cases of one parametrized test the fast tier runs (``pytest -m "not slow"``): the first that
is not marked slow. The rest are marked ``slow`` at collection, so the full suite (CI) runs every
case and the inner loop still runs every test function once (docs/testing.md)."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    kept: dict[tuple[str, str], int] = {}
    for item in items:
        if getattr(item, "callspec", None) is None or item.get_closest_marker("slow"):
            continue
        function = (item.nodeid.partition("::")[0], getattr(item, "originalname", item.name))
        kept[function] = kept.get(function, 0) + 1
        if kept[function] > FAST_CASES_PER_TEST:
            item.add_marker(pytest.mark.slow)


# -- fixtures --------------------------------------------------------------------------------

CliRunner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run_cli(capsys) -> CliRunner:
    """``run_cli(main, *args) -> (exit code, stdout, stderr)``: a CLI's ``main(argv)`` called in
    this process; argparse rejects a bad value with SystemExit before main's body runs, and its
    code is returned the same way."""

    def run(main: Callable[[list[str]], int], *args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture
def write_json(tmp_path) -> Callable[[str, Any], str]:
    """``write_json(name, document) -> path``: ``tmp_path / name`` holding ``document`` as JSON
    (a ``str`` document is written as it is, to test files that are not valid JSON)."""

    def write(name: str, document: Any) -> str:
        path = tmp_path / name
        path.write_text(document if isinstance(document, str) else json.dumps(document))
        return str(path)

    return write


@pytest.fixture(scope="session")
def gpt_graph() -> LayerGraph:
    """examples/gpt-1.3b.json, loaded once per run: do not modify it in a test."""
    return load_graph(GPT_1_3B)


# -- cost coefficients ---------------------------------------------------------------------------

FP32_ADAM = {"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8}
"""fp32 Adam's (w, g, o) bytes per parameter, as TrainingConfig keywords."""


def costs_of(
    graph: LayerGraph | dict,
    config: ParallelConfig,
    *,
    cluster: Cluster | None = None,
    **training: Any,
) -> LayerCosts:
    """``layer_costs`` of ``graph`` (or its document) under ``config`` on ``cluster`` (default:
    ``config.num_gpus`` GPUs), with ``TrainingConfig(global_batch=config.global_batch,
    **training)``; the coefficients read only its runtime, bytes per parameter, precision,
    optimizer, gradient lifetime, deallocation, capacity factor and memory model, not its
    search lists."""
    if isinstance(graph, dict):
        graph = graph_from_dict(graph)
    options = TrainingConfig(global_batch=config.global_batch, **training)
    return layer_costs(graph, config, cluster or Cluster(num_gpus=config.num_gpus), options)


def fp32_adam_costs(
    graph: LayerGraph,
    config: ParallelConfig,
    *,
    runtime: str = "torch",
    lifetime: str = "persistent",
    **training: Any,
) -> LayerCosts:
    """``costs_of`` with fp32 Adam (4, 4, 8 bytes per parameter) on ``runtime``, gradients
    ``lifetime`` (persistent | step)."""
    return costs_of(graph, config, runtime=runtime, grad_lifetime=lifetime, **FP32_ADAM, **training)


# -- solver oracles ------------------------------------------------------------------------------


def assert_backends_match_brute_force(problem) -> None:
    """CP-SAT and the MILP both prove brute force's optimum of ``problem`` (a StageProblem), and
    the split each returns measures that objective."""
    from solver.backends.brute_force import solve_brute_force
    from solver.backends.cpsat import solve_cpsat
    from solver.backends.milp import solve_milp
    from solver.backends.problem import OPTIMAL

    oracle = solve_brute_force(problem)
    for solve in (solve_cpsat, solve_milp):
        solution = solve(problem, time_limit_s=30)
        assert solution.status == oracle.status == OPTIMAL
        assert solution.objective == oracle.objective
        assert problem.objective_value(solution.stage_of_layer, solution.recomputed) == (
            oracle.objective
        )


def assert_placed_backends_match_brute_force(group_costs: list, rng) -> None:
    """A two-group heterogeneous placement of ``group_costs`` (one LayerCosts per group, same
    layers and config): capacities 0.9x and 1.5x the even split's peak on the first group's
    costs, a random share of the stages per group, absolute memory objective; CP-SAT and the
    MILP reach brute force's status and objective."""
    from solver.backends.brute_force import solve_brute_force
    from solver.backends.cpsat import solve_cpsat
    from solver.backends.milp import solve_milp
    from solver.backends.problem import ABSOLUTE, Placement, StageProblem
    from solver.costs import stage_costs

    costs = group_costs[0]
    layers, pp = len(costs.weight_bytes), costs.config.pp
    even = [min(i * pp // layers, pp - 1) for i in range(layers)]
    peak = max(s.peak_bytes for s in stage_costs(costs, even))
    small = rng.randint(1, pp - 1)
    placement = Placement(
        group_costs=group_costs,
        capacity_bytes=[int(peak * 0.9), int(peak * 1.5)],
        stages_per_group=[small, pp - small],
        names=["small", "large"],
        memory_objective=ABSOLUTE,
    )
    problem = StageProblem(costs=costs, placement=placement)
    reference = solve_brute_force(problem)
    for solve in (solve_cpsat, solve_milp):
        solution = solve(problem, time_limit_s=20)
        assert (solution.status, solution.objective) == (reference.status, reference.objective)


def solve_everywhere(problem, chain: bool) -> set[int]:
    """The objectives CP-SAT, the MILP and (``chain``) the chain algorithm prove optimal for
    ``problem``, each equal to its split's measured value (callers compare the set with brute
    force's optimum)."""
    from solver.backends.chain import solve_chain
    from solver.backends.cpsat import solve_cpsat
    from solver.backends.milp import solve_milp
    from solver.backends.problem import OPTIMAL

    solutions = [solve_cpsat(problem, time_limit_s=30), solve_milp(problem, time_limit_s=30)]
    if chain:
        solutions.append(solve_chain(problem))
    for solution in solutions:
        assert solution.status == OPTIMAL, solution
        assert solution.objective == problem.objective_value(
            solution.stage_of_layer, solution.recomputed
        )
    return {solution.objective for solution in solutions}


def t5_like_graph(*, named: bool = True) -> LayerGraph:
    """A T5-shaped DAG, bytes per sample: the encoder output (one tensor, 8 B) feeds both decoder
    blocks; ``named`` False leaves the edges without tensor ids (one tensor per edge)."""
    layers = [
        {"name": name, "params": 10, "activation_bytes": 50, "output_bytes": 8}
        for name in ("enc", "dec_embed", "dec0", "dec1")
    ]
    edges = [
        {"src": "enc", "dst": "dec0", "bytes": 8, "tensor": "enc:0"},
        {"src": "enc", "dst": "dec1", "bytes": 8, "tensor": "enc:0"},
        {"src": "dec_embed", "dst": "dec0", "bytes": 6},
        {"src": "dec0", "dst": "dec1", "bytes": 7},
    ]
    if not named:
        edges = [{k: v for k, v in edge.items() if k != "tensor"} for edge in edges]
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "t5", "layers": layers, "edges": edges}
    )


# -- real runs (profiling.run) ---------------------------------------------------------------------


def assert_runs_match_reference(reports, loss: float, grads: dict, tolerance: float) -> None:
    """Every rank of a ``profiling.run`` run (``RankReport``s with captured gradients) holds the
    single-process reference's gradient of each of its parameters within ``tolerance``
    (relative norm), every parameter is on some rank, and the mean over the ranks' last losses
    is the reference ``loss``."""
    seen = set()
    for report in reports:
        assert report.grads, f"rank {report.rank} captured no gradients"
        for name, grad in report.grads.items():
            expected = grads[name]
            error = float((grad - expected).norm() / expected.norm())
            assert error <= tolerance, f"rank {report.rank} {name}: relative error {error:.3g}"
            seen.add(name)
    assert seen == set(grads), f"parameters without a gradient: {set(grads) - seen}"
    last = [report.losses[-1] for report in reports if report.losses]  # one per replica
    assert sum(last) / len(last) == pytest.approx(loss, rel=tolerance)


def assert_peaks_within(
    reports, *, under_pct: float, over_pct: float, first_iteration: bool = False
) -> None:
    """Every rank's measured peak against its plan's (``RankReport.error_pct``, negative when
    the plan under-predicts): -``under_pct`` <= error <= ``over_pct``. ``first_iteration``: the
    run measured its first iteration, before Adam's first step made its state, so a stage whose
    peak comes before the step measures its prediction less the optimizer state: the upper end
    is taken from the prediction less the predicted optimizer state there."""
    for report in reports:
        predicted, measured = report.predicted_peak_bytes, report.measured_peak_bytes
        where = f"rank {report.rank} (stage {report.stage}): {report.error_pct:+.1f}%"
        assert predicted >= measured * (1 - under_pct / 100), where
        if first_iteration:
            predicted -= report.predicted_breakdown["optimizer"]
        assert predicted <= measured * (1 + over_pct / 100), where
