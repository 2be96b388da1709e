"""Golden answers of the cost model: a few hundred random evaluations and everything the cost
model says about each (coefficients, stage costs and peak moments, bounds, simulated schedule).

``tests/data/costs_golden.json.gz`` holds, per case, its inputs (graph document, config,
training options, cluster, split, recompute flags) and the answers the code gave when it was
written; ``tests/test_costs_golden.py`` recomputes the answers from the stored inputs and
compares them exactly, so a refactoring of ``solver.costs`` that changes any plan, peak, time
or message fails. Regenerate only for an intended change of the model::

    python -m tests.costs_golden            # rewrites tests/data/costs_golden.json.gz

Cases: random chains and DAGs (``tests.random_graphs``) with the optional layer and edge fields
filled at random (experts, K/V, sequence-parallel gathers, batch-independent parts, measured
times, tensors sent to
several consumers, saved/charged flags, profiled timing), random configs (pp, tp, dp, cp, ep,
micro-batch, ZeRO 0-3, recompute none/full/selective, 1F1B/GPipe/interleaved, SP), both
runtimes, gradient lifetimes, optimizer implementations, capacity factors, calibrations,
empirical statistics, heterogeneous placements, and inputs the model refuses (their message).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from solver.calibration import Calibration
from solver.costs import (
    bound_terms,
    boundary_bytes,
    direct_buffer_adjustments,
    iteration_bound_ns,
    iteration_floor_ns,
    layer_costs,
    pipeline_link_gb_per_s,
    placed_stage_costs,
    stage_costs,
)
from solver.costs.schedule_time import stages_timeline
from solver.errors import InputError
from solver.evaluation import evaluate_assignment
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_chain, random_dag

GOLDEN_PATH = Path(__file__).parent / "data" / "costs_golden.json.gz"
SEED = 26
NUM_CASES = 400


# -- random inputs ----------------------------------------------------------------------------


def _decorate_layers(rng: random.Random, layers: list[dict], moe: bool) -> None:
    """Fill the optional layer fields at random (in place), within what the format accepts."""
    measured = rng.random() < 0.25
    for i, layer in enumerate(layers):
        params, tp_params = layer["params"], layer.get("tp_params", 0)
        activation = layer["activation_bytes"]
        tp_activation = layer.get("tp_activation_bytes", 0)
        if rng.random() < 0.5 and layer.get("transient_bytes"):
            layer["weight_grad_transient_bytes"] = rng.randint(0, layer["transient_bytes"])
        if rng.random() < 0.6:
            layer["largest_param"] = rng.randint(0, params - tp_params)
            layer["largest_tp_param"] = rng.randint(0, tp_params)
        if rng.random() < 0.6:
            layer["attention_kv_bytes"] = rng.randint(1, 40) * 64
            # explicit attention's scores (Megatron's own buffers), drawn from no rng call so
            # the other cases keep their inputs
            layer["attention_score_bytes"] = 3 * layer["attention_kv_bytes"]
        if rng.random() < 0.5:
            layer["sp_gathered_bytes"] = rng.randint(0, activation)
        if rng.random() < 0.3:
            layer["bwd_flops"] = layer["fwd_flops"] * rng.choice([1.5, 2.0, 3.0])
        if measured:
            layer["fwd_ms"] = rng.randint(1, 200) / 100
            layer["bwd_ms"] = rng.randint(1, 400) / 100
        if moe and 0 < i < len(layers) - 1 and params > tp_params and rng.random() < 0.7:
            expert = rng.randint(1, params - tp_params)
            layer["expert_params"] = expert
            if "largest_param" in layer and rng.random() < 0.5:
                layer["largest_param"] = rng.randint(0, expert)
            layer["expert_activation_bytes"] = rng.randint(0, activation - tp_activation)
            layer["ep_comm_bytes"] = rng.randint(0, 40) * 16
        if len(layers) % 3 == 0:  # a third of the graphs, the others as written before
            _batch_independent(layer)
        layer["kind"] = "block"
    if rng.random() < 0.6:
        layers[0]["kind"] = "embedding"
        layers[-1]["kind"] = "head"


def _batch_independent(layer: dict) -> None:
    """Batch-independent parts (``unbatched_*``) on some layers, drawn from no rng call so the
    other cases keep their inputs: a shared part of the saved bytes (sometimes above the
    replicated part the model caps it at), of the transient (or a negative one, a copy batch 1
    skips) and of the weight-gradient moment."""
    activation, transient = layer["activation_bytes"], layer.get("transient_bytes", 0)
    if activation % 5 == 0:
        layer["unbatched_activation_bytes"] = activation // 4
    if transient and transient % 3 == 0:
        layer["unbatched_transient_bytes"] = transient // 4
    elif transient and transient % 3 == 1:
        layer["unbatched_transient_bytes"] = -(transient // 8)
    at_grad = layer.get("weight_grad_transient_bytes")
    if at_grad and at_grad % 2 == 0:
        layer["unbatched_weight_grad_transient_bytes"] = at_grad // 2


def _decorate_edges(rng: random.Random, edges: list[dict]) -> None:
    """Name tensors sent to several consumers and set requires_grad/saved/charged at random."""
    by_src: dict[str, list[dict]] = {}
    for edge in edges:
        by_src.setdefault(edge["src"], []).append(edge)
    for src, group in by_src.items():
        shared = len(group) > 1 and rng.random() < 0.6
        requires_grad = rng.random() < 0.85
        src_charged = rng.random() < 0.2
        size = group[0]["bytes"]
        for edge in group:
            if shared:
                edge["tensor"] = f"{src}:0"
                edge["bytes"] = size
            if not requires_grad or shared:
                edge["requires_grad"] = requires_grad
            if src_charged and (shared or len(group) == 1):
                edge["src_charged"] = True
            saved = rng.choice([None, True, False])
            if saved is not None:
                edge["saved"] = saved
                if saved and rng.random() < 0.6:
                    edge["charged"] = True


def random_graph_document(rng: random.Random) -> dict[str, Any]:
    """A random graph as a v1 document (a chain or a DAG of 3 to 9 layers, maybe MoE)."""
    num_layers = rng.randint(3, 9)
    dag = rng.random() < 0.45
    graph = (random_dag if dag else random_chain)(rng, num_layers)
    document = graph.to_dict()
    moe = rng.random() < 0.3
    _decorate_layers(rng, document["layers"], moe)
    if dag:
        _decorate_edges(rng, document["edges"])
    meta: dict[str, Any] = {}
    if rng.random() < 0.7:
        meta["seq_len"] = rng.choice([64, 96, 128, 90])
    if rng.random() < 0.3:
        meta["unsaved_output_bytes"] = rng.choice([4, 256, 4096])
    if rng.random() < 0.35:
        timing: dict[str, Any] = {"threads": 4}
        for key, scale in (
            ("optimizer_step_ns_per_param", 0.05),
            ("microbatch_overhead_ns", 20_000.0),
            ("step_overhead_ns", 100_000.0),
        ):
            if rng.random() < 0.7:
                timing[key] = round(rng.uniform(0.1, 2.0) * scale, 3)
        meta["timing"] = timing
    if moe:
        num_experts = rng.choice([4, 8])
        meta["moe"] = {
            "num_experts": num_experts,
            "top_k": rng.choice([1, 2]),
            "shared_experts": rng.choice([0, 1]),
            "capacity_factor": rng.choice([1.0, 1.0, 1.25]),
        }
    if meta:
        document["meta"] = meta
    return document


def _empirical_document(rng: random.Random) -> dict[str, Any]:
    """A chain with mCAP/CAPSlog statistics on every layer."""
    document = random_chain(rng, rng.randint(3, 8)).to_dict()
    for layer in document["layers"]:
        added = rng.randint(1, 100) * 1000
        layer["mem_added"] = added
        layer["mem_isolated"] = added + rng.randint(0, 50) * 1000
    return document


def _random_config(rng: random.Random, num_layers: int, document: dict) -> dict[str, Any]:
    pp = rng.randint(1, min(4, num_layers))
    tp = rng.choice([1, 1, 2, 4])
    dp = rng.choice([1, 2, 4])
    schedule = rng.choice(["1f1b", "1f1b", "gpipe"])
    m = rng.choice([1, 2, 3, 4, 8])
    virtual = 1
    if schedule == "1f1b" and pp >= 2 and rng.random() < 0.3:
        virtual = 2 if 2 * pp <= num_layers else 1
        if virtual > 1:
            m = pp * rng.choice([1, 2])
    experts = document.get("meta", {}).get("moe", {}).get("num_experts")
    ep = 1
    if experts and rng.random() < 0.7:
        ep = rng.choice([e for e in (1, 2, 4) if dp % e == 0 and experts % e == 0])
    return {
        "pp": pp,
        "tp": tp,
        "dp": dp,
        "micro_batch": rng.choice([1, 2]),
        "num_microbatches": m,
        "zero": rng.choice([0, 1, 2, 3]),
        "recompute": rng.choice(["none", "none", "full", "selective"]),
        "schedule": schedule,
        "virtual_stages": virtual,
        "sp": tp > 1 and rng.random() < 0.5,
        "cp": rng.choice([1, 1, 1, 2, 4]),
        "ep": ep,
    }


def _random_training(rng: random.Random) -> dict[str, Any]:
    runtime = rng.choice(["megatron", "torch"])
    options: dict[str, Any] = {"runtime": runtime}
    if rng.random() < 0.4:
        options["precision"] = rng.choice(["fp32", "bf16", "bf16-mixed", "fp16-mixed"])
    if rng.random() < 0.2:
        options["optimizer"] = rng.choice(["adamw", "sgd", "lion"])
    if runtime == "torch":
        options["grad_lifetime"] = rng.choice(["step", "step", "persistent"])
    else:
        options["deallocate_pipeline_outputs"] = rng.random() < 0.7
    if rng.random() < 0.4:
        options["optimizer_impl"] = rng.choice(["foreach", "fused"])
    if rng.random() < 0.4:
        options["moe_capacity_factor"] = rng.choice([1.25, 2.0, "dropless"])
    if rng.random() < 0.15:
        options["calibration"] = {
            "scales": {
                key: round(rng.uniform(0.8, 1.3), 3)
                for key in ("weights", "grads", "optimizer", "activations", "buffers", "transient")
                if rng.random() < 0.6
            },
            "constant_bytes": rng.choice([0, 1 << 20, -(1 << 10)]),
        }
    return options


def _random_cluster(rng: random.Random, config: dict) -> dict[str, Any]:
    width = config["tp"] * config["cp"] * config["dp"]
    num_gpus = config["pp"] * width
    cluster: dict[str, Any] = {
        "num_gpus": num_gpus,
        "gpus_per_node": rng.choice([2, 4, 8]),
        "p2p_latency_us": rng.choice([0.0, 0.0, 10.0]),
    }
    if rng.random() < 0.3:
        cluster["gpu_flops"] = rng.choice([1e12, 312e12])
        cluster["intra_node_gb_per_s"] = rng.choice([0.5, 150.0])
        cluster["inter_node_gb_per_s"] = rng.choice([0.1, 12.5])
    return cluster


def _split(rng: random.Random, num_layers: int, num_stages: int) -> list[int]:
    """A random contiguous split into ``num_stages`` non-empty stages (layer -> stage)."""
    cuts = sorted(rng.sample(range(1, num_layers), num_stages - 1))
    bounds = [0, *cuts, num_layers]
    return [j for j in range(num_stages) for _ in range(bounds[j], bounds[j + 1])]


def random_case(rng: random.Random) -> dict[str, Any]:
    """One case's inputs (JSON-able)."""
    empirical = rng.random() < 0.06
    document = _empirical_document(rng) if empirical else random_graph_document(rng)
    num_layers = len(document["layers"])
    config = _random_config(rng, num_layers, document)
    training = _random_training(rng)
    if empirical:
        training = {"memory_model": "empirical"}
        config |= {"tp": 1, "dp": 1, "cp": 1, "ep": 1, "sp": False, "virtual_stages": 1}
        config["recompute"] = rng.choice(["none", "full"])
    cluster = _random_cluster(rng, config)
    placement = None
    if not empirical and config["virtual_stages"] == 1 and rng.random() < 0.1:
        placement = [rng.randrange(2) for _ in range(config["pp"])]
    if rng.random() < 0.02:  # beyond the exact range: a refused input
        document["layers"][0]["params"] = 2**47
        document["layers"][0]["tp_params"] = 0
        document["layers"][0].pop("largest_tp_param", None)
        training["weight_bytes_per_param"] = 256
    num_stages = config["pp"] * config["virtual_stages"]
    recomputed = None
    if config["recompute"] == "selective":
        recomputed = [rng.random() < 0.5 for _ in range(num_layers)]
    return {
        "graph": document,
        "config": config,
        "training": training,
        "cluster": cluster,
        "placement": placement,
        "split": _split(rng, num_layers, num_stages),
        "recomputed": recomputed,
    }


def cases(seed: int = SEED, count: int = NUM_CASES) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_case(rng) for _ in range(count)]


# -- answers ----------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """JSON-able form of numpy arrays and scalars, tuples, dataclasses' dicts."""
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _digest(value: Any) -> str:
    """A short digest of a bulky answer (a timeline's actions)."""
    text = json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


LAYER_FIELDS = (
    "weight_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "stored_bytes",
    "transient_bytes",
    "time_ns",
    "dp_sync_ns",
    "edge_src",
    "edge_dst",
    "edge_bytes",
    "edge_tensor",
    "edge_requires_grad",
    "edge_saved",
    "edge_charged",
    "edge_src_charged",
    "in_flight",
    "in_flight_vectors",
    "backwards_done",
    "running_chunks",
    "moment_copies",
    "receive_copies",
    "send_copies",
    "runtime",
    "deallocate_pipeline_outputs",
    "constant_bytes",
    "recompute_stored_bytes",
    "recompute_transient_bytes",
    "recompute_time_ns",
    "recomputable",
    "grad_lifetime",
    "grad_buffer_bytes",
    "step_bytes",
    "forward_ns",
    "optimizer_step_ns",
    "microbatch_overhead_ns",
    "step_overhead_ns",
    "p2p_latency_ns",
    "dp_overlap",
)
"""The ``LayerCosts`` fields recorded (config and links separately)."""


def _layer_answers(costs) -> dict[str, Any]:
    answers = {name: _plain(getattr(costs, name)) for name in LAYER_FIELDS}
    links = costs.link_gb_per_s
    answers["links"] = (
        None
        if links is None
        else _plain(
            {
                f"{x},{y}": links[(x, y)]
                for x in range(costs.num_ranks)
                for y in range(costs.num_ranks)
            }
        )
    )
    answers |= {
        "tensor_groups": _plain(costs.tensor_groups),
        "tensor_roles": _plain(costs.tensor_roles),
        "plain_boundaries": bool(costs.plain_boundaries),
        "first_backward_peak": _plain(costs.first_backward_peak),
        "state_lower_bytes": _plain(costs.state_lower_bytes),
        "state_bytes": _plain(costs.state_bytes),
        "least_held": costs.least_held,
        "is_chain": bool(costs.is_chain()),
        "has_compute_time": bool(costs.has_compute_time),
        "tail_ns": _plain(costs.tail_ns),
        "backward_ns": _plain(costs.backward_ns),
        "recompute_backward_ns": _plain(costs.recompute_backward_ns),
        "bounding_min": _plain(costs.bounding_coefficients(np.minimum)),
        "bounding_max": _plain(costs.bounding_coefficients(np.maximum)),
        "uniform_full": _plain(costs.uniform(True).coefficients(None)),
        "bound_terms": _plain(bound_terms(costs)),
        "iteration_floor_ns": iteration_floor_ns(costs),
    }
    return answers


def _stage_answers(stage) -> dict[str, Any]:
    fields = dict(vars(stage))
    return _plain(fields) | {"peak_bytes": stage.peak_bytes, "breakdown": stage.breakdown()}


def _objects(case: dict[str, Any]):
    """(graph, config, cluster, training) of a case."""
    graph = graph_from_dict(case["graph"], origin="<golden>")
    config = ParallelConfig(**case["config"])
    cluster = Cluster(**case["cluster"])
    options = dict(case["training"])
    if "calibration" in options:
        options["calibration"] = Calibration(**options["calibration"])
    training = TrainingConfig(global_batch=config.global_batch, **options)
    return graph, config, cluster, training


def _group_clusters(case: dict[str, Any], cluster: Cluster) -> list[Cluster]:
    """Two node groups' clusters for a placed case: the case's and a slower, smaller one."""
    slow = dict(case["cluster"])
    slow |= {"gpu_flops": 312e12, "intra_node_gb_per_s": 300.0, "gpus_per_node": 4}
    return [cluster, Cluster(**slow)]


def answers(case: dict[str, Any]) -> dict[str, Any]:
    """Everything the cost model answers for one case (or the message it refuses it with)."""
    try:
        return _answers(case)
    except InputError as error:
        return {"error": str(error)}


def _answers(case: dict[str, Any]) -> dict[str, Any]:
    graph, config, cluster, training = _objects(case)
    costs = layer_costs(graph, config, cluster, training)
    split, recomputed = case["split"], case["recomputed"]
    stage_of = np.asarray(split, dtype=np.int64)
    result = {"layer_costs": _layer_answers(costs)}
    if case["placement"] is not None:
        group_costs = [
            layer_costs(graph, config, group, training) for group in _group_clusters(case, cluster)
        ]
        stages = placed_stage_costs(group_costs, split, case["placement"], recomputed)
    else:
        stages = stage_costs(costs, split, recomputed)
    result["stages"] = [_stage_answers(stage) for stage in stages]
    result["boundary_bytes"] = _plain(boundary_bytes(costs, stage_of))
    result["direct_buffer_adjustments"] = _plain(direct_buffer_adjustments(costs, stage_of))
    result["pipeline_links"] = _plain(
        {f"{x},{y}": v for (x, y), v in pipeline_link_gb_per_s(config, cluster).items()}
    )
    result["iteration_bound_ns"] = iteration_bound_ns(costs, stages)
    timeline = stages_timeline(costs, stages, split)
    result["timeline"] = {
        "makespan_ns": timeline.makespan_ns,
        "busy_ns": timeline.busy_ns,
        "tail_ns": timeline.tail_ns,
        "idle_ns": timeline.idle_ns,
        "actions": _digest([[(a, s, e) for a, s, e in rank] for rank in timeline.actions]),
    }
    if case["placement"] is None:
        evaluation = evaluate_assignment(
            graph,
            costs,
            split,
            cluster=cluster,
            training=training,
            recomputed=recomputed if costs.selective else None,
        )
        result["evaluation"] = {
            "peak_bytes": evaluation.peak_bytes,
            "iteration_ns": evaluation.iteration_ns,
            "iteration_bound_ns": evaluation.iteration_bound_ns,
            "utilization_ppm": evaluation.utilization_ppm,
            "fits": evaluation.fits,
            "throughput": evaluation.throughput,
        }
    return result


def golden(seed: int = SEED, count: int = NUM_CASES) -> list[dict[str, Any]]:
    """Every case with its answers."""
    return [{"input": case, "answers": answers(case)} for case in cases(seed, count)]


def load_golden(path: Path = GOLDEN_PATH) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as file:
        return json.load(file)


def write_golden(path: Path = GOLDEN_PATH) -> list[dict[str, Any]]:
    records = golden()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(records, sort_keys=True, separators=(",", ":"))
    with gzip.GzipFile(path, "wb", mtime=0) as file:
        file.write(text.encode())
    return records


if __name__ == "__main__":
    written = write_golden()
    errors = sum("error" in record["answers"] for record in written)
    print(f"{GOLDEN_PATH}: {len(written)} cases, {errors} refused inputs")
