"""Memory-centric planner: partition and parallelise a layer graph to minimise per-GPU peak memory.

    from solver import load_graph, load_plan, Cluster, DEFAULT_RESERVE, TrainingConfig, plan
    graph = load_graph("examples/gpt-1.3b.json")
    result = plan(graph, Cluster(num_gpus=16, gpu_memory_bytes=80 * 2**30),
                  TrainingConfig(global_batch=64, precision="bf16-mixed", optimizer="adam",
                                 reserve=DEFAULT_RESERVE))  # as the CLI: 1 GiB + 5% kept back
    print(result.config, result.peak_bytes, result.throughput)
    again = load_plan("plan.json")  # a plan file (solver.plan --json), checked: a PlanFile

The solver never imports torch.
"""

from solver.errors import InfeasibleError, InputError, NoSolutionError, PlannerError
from solver.evaluation import Evaluation, evaluate
from solver.files.cluster_file import load_cluster
from solver.files.plan_file import PlanFile, evaluate_plan, load_plan
from solver.graph import Edge, Layer, LayerGraph, graph_from_dict, load_graph
from solver.precision import OPTIMIZERS, PRECISIONS
from solver.reserve import DEFAULT_RESERVE, MemoryReserve, default_reserve, parse_reserve
from solver.search.planner import Plan, plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig

__all__ = [
    "DEFAULT_RESERVE",
    "OPTIMIZERS",
    "PRECISIONS",
    "Cluster",
    "MemoryReserve",
    "Edge",
    "Evaluation",
    "InfeasibleError",
    "InputError",
    "Layer",
    "LayerGraph",
    "NoSolutionError",
    "ParallelConfig",
    "Plan",
    "PlanFile",
    "PlannerError",
    "TrainingConfig",
    "default_reserve",
    "evaluate",
    "evaluate_plan",
    "graph_from_dict",
    "load_cluster",
    "load_graph",
    "load_plan",
    "parse_reserve",
    "plan",
]
