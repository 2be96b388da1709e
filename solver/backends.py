"""One entry point for the per-config solvers: chain algorithm, CP-SAT, MILP."""

from __future__ import annotations

from solver.errors import InputError
from solver.problem import StageProblem, StageSolution

BACKENDS = ("auto", "cpsat", "milp", "chain")


def resolve_backend(backend: str, graph_is_chain: bool, *, heterogeneous: bool = False) -> str:
    """'auto' is the exact chain algorithm on chain graphs and CP-SAT on DAGs; on a heterogeneous
    cluster (stages also choose a node group, ``solver.formulation``) it is CP-SAT, since the chain
    algorithm has a single capacity and one time per layer."""
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "chain" if graph_is_chain and not heterogeneous else "cpsat"
    if backend == "chain" and heterogeneous:
        raise InputError(
            "--backend chain does not place stages on node groups; on a heterogeneous cluster "
            "use --backend auto, cpsat or milp"
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
    num_workers: int = 1,
) -> StageSolution:
    """Solve one config's problem exactly with a resolved backend name."""
    if backend == "chain":
        from solver.chain import solve_chain

        return solve_chain(problem, time_limit_s=time_limit_s)
    if backend == "cpsat":
        from solver.cpsat import solve_cpsat

        return solve_cpsat(problem, time_limit_s=time_limit_s, hint=hint, num_workers=num_workers)
    if backend == "milp":
        from solver.milp import solve_milp

        return solve_milp(problem, time_limit_s=time_limit_s, hint=hint)
    raise ValueError(f"unresolved backend {backend!r}")
