"""One entry point for the per-config solvers: chain algorithm, DAG dynamic program, CP-SAT,
MILP."""

from __future__ import annotations

from solver.backends.problem import StageProblem, StageSolution
from solver.errors import InputError

BACKENDS = ("auto", "cpsat", "milp", "chain", "dag")


def resolve_backend(
    backend: str,
    graph_is_chain: bool,
    *,
    heterogeneous: bool = False,
    selective: bool = False,
    interleaved: bool = False,
    dag_fits: bool = False,
) -> str:
    """'auto' is the exact chain algorithm on chain graphs, the exact DP over ideals
    (``backends.dag``) on DAGs whose ideals are within its caps (``dag_fits``:
    ``backends.dag.dag_fits_graph`` of the graph's coefficients), else CP-SAT. It is CP-SAT on a
    heterogeneous cluster too (stages also choose a node group,
    ``solver.backends.formulation``: the chain
    algorithm has a single capacity and one time per layer), and whenever the recomputed layers
    are a decision (``selective``): the chain algorithm fixes every layer's costs, and choosing
    the recompute subset of each stage under a time limit is a knapsack it does not solve. And
    with interleaved stages (v > 1): a rank's memory sums non-contiguous chunks, which the chain
    algorithm's contiguous-stage recursion does not describe."""
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    plain = not (heterogeneous or selective or interleaved)
    if backend == "auto":
        if plain and graph_is_chain:
            return "chain"
        return "dag" if plain and dag_fits else "cpsat"
    if backend == "dag":
        from solver.backends.dag import check_plain

        check_plain(heterogeneous=heterogeneous, selective=selective, interleaved=interleaved)
        return backend
    if backend == "chain" and heterogeneous:
        raise InputError(
            "--backend chain does not place stages on node groups; on a heterogeneous cluster "
            "use --backend auto, cpsat or milp"
        )
    if backend == "chain" and selective:
        raise InputError(
            "--backend chain does not choose recomputed layers (recompute selective/auto): "
            "use --backend cpsat or milp"
        )
    if backend == "chain" and interleaved:
        raise InputError(
            "--backend chain does not plan interleaved stages (--virtual-stages > 1) or "
            "split-backward schedules (interleaved-zb, zbv, dualpipev): use "
            "--backend auto, cpsat or milp"
        )
    if backend == "chain" and not graph_is_chain:
        raise InputError(
            "--backend chain needs a chain graph (each layer feeds only the next); "
            "this graph is a DAG: use --backend cpsat or milp"
        )
    return backend


def solve(
    problem: StageProblem,
    backend: str,
    *,
    time_limit_s: float,
    hint: list[int] | None = None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
    num_workers: int = 1,
) -> StageSolution:
    """Solve one config's problem exactly with a resolved backend name (the hint: a split, and
    its recompute flags under selective recomputation, the group of each stage with a
    placement). A problem whose time is the simulated one (``StageProblem.simulated``) is
    solved by bounding and simulating (``solver.backends.simulated``), one implementation for
    every backend."""
    from solver.backends.simulated import CUT_BACKENDS, needs_simulation, solve_simulated

    if needs_simulation(problem):
        return solve_simulated(
            problem,
            lambda bound_problem, **hints: _solve_bound(
                bound_problem, backend, num_workers=num_workers, **hints
            ),
            cuts=backend in CUT_BACKENDS,
            time_limit_s=time_limit_s,
            hint=hint,
            hint_recomputed=hint_recomputed,
            hint_groups=hint_groups,
        )
    return _solve_bound(
        problem,
        backend,
        time_limit_s=time_limit_s,
        hint=hint,
        hint_recomputed=hint_recomputed,
        hint_groups=hint_groups,
        num_workers=num_workers,
    )


def _solve_bound(
    problem: StageProblem,
    backend: str,
    *,
    time_limit_s: float,
    hint: list[int] | None = None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
    num_workers: int = 1,
) -> StageSolution:
    """One backend's solve of the problem its model states (the iteration bound)."""
    if backend == "chain":
        from solver.backends.chain import solve_chain

        return solve_chain(problem, time_limit_s=time_limit_s)
    if backend == "dag":
        from solver.backends.dag import solve_dag

        return solve_dag(problem, time_limit_s=time_limit_s)
    if backend == "cpsat":
        from solver.backends.cpsat import solve_cpsat

        return solve_cpsat(
            problem,
            time_limit_s=time_limit_s,
            hint=hint,
            hint_recomputed=hint_recomputed,
            hint_groups=hint_groups,
            num_workers=num_workers,
        )
    if backend == "milp":
        from solver.backends.milp import solve_milp

        return solve_milp(
            problem,
            time_limit_s=time_limit_s,
            hint=hint,
            hint_recomputed=hint_recomputed,
            hint_groups=hint_groups,
        )
    raise ValueError(f"unresolved backend {backend!r}")
