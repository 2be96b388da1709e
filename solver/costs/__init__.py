"""The analytic cost model: the ONLY place memory and time are computed.

Every backend (chain algorithm, DAG, CP-SAT, MILP), the baselines, the evaluation and the reports
use the per-layer coefficients of :func:`layer_costs` and the stage totals of :func:`stage_costs`,
imported from here. One concern per module, each docstring with its formulas (the long form, with
assumptions and sources, is docs/cost-model.md):

  schedule          schedule order, in-flight micro-batches k_s, boundary copies R_s / S_s
  schedule_time     the iteration by simulating that schedule, action by action
  schedule_memory   each rank's memory at every action of that schedule (its max: the peak)
  graph_inputs      everything the model reads from a layer graph
  states            parameters per GPU, weights / gradients / optimizer state, ZeRO, step temporary
  layers            ``layer_costs``: the per-layer coefficients (activations, transients, ...)
  coefficients      ``LayerCosts``, the coefficients every backend reads
  boundaries        tensors crossing stage boundaries, relays, the runtime's buffers
  times             layer times, gradient sync, optimizer step, pipeline links
  context_parallel  ring attention, the sequence split, the cp checks
  moe, experts      the router read from the graph; the routed experts' memory and all-to-alls
  megatron_linear, megatron_attention
                    what megatron-core's linears and its own explicit attention hold beyond
                    the profile (--runtime megatron)
  stages            ``StageCost`` totals and peak moments of an assignment (``stage_cost``)
  bounds            the iteration bound and floor the backends search with
  ranges            the range the model's integers stay exact in
  empirical         the mCAP/CAPSlog statistics as coefficients
  units             ns per ms, exact ceil division

Notation shared by all: config (p, t, d), context-parallel degree c, expert-parallel degree ep,
micro-batch b, global batch B, m = B / (d b) micro-batches per step, bytes per parameter
(w, g, o), ZeRO stage z, stages s = 0..p-1, layers l; bytes per GPU, times in integer ns.
"""

from solver.costs.boundaries import (
    BoundaryTensors,
    boundary_bytes,
    direct_boundary_bytes,
    direct_buffer_adjustments,
    stage_buffer_bytes,
)
from solver.costs.bounds import BoundTerm, bound_terms, iteration_bound_ns, iteration_floor_ns
from solver.costs.coefficients import LayerCosts
from solver.costs.context_parallel import (
    RING_BACKWARD_CHUNKS,
    ring_attention_bytes,
    ring_attention_pass_ns,
    ring_bytes_per_ns,
)
from solver.costs.empirical import empirical_layer_costs
from solver.costs.experts import (
    expert_all_to_all_ns,
    expert_stored_bytes,
    largest_local_param,
    routing_factor,
)
from solver.costs.graph_inputs import (
    graph_columns,
    graph_totals,
    recomputable_layers,
    unsaved_output_bytes,
)
from solver.costs.layers import layer_costs
from solver.costs.moe import (
    RoutedExperts,
    check_expert_degree,
    num_routed_experts,
    routed_experts,
)
from solver.costs.ranges import MAX_EXACT_BYTES, MAX_ITERATION_NS, check_exact_range
from solver.costs.schedule import (
    ScheduleAction,
    boundary_copies,
    forwards_before_first_backward,
    in_flight_microbatches,
    in_flight_vectors,
    interleaved_schedule_groups,
    schedule_actions,
    schedule_moments,
    stage_boundary_copies,
)
from solver.costs.schedule_memory import RankMemory, rank_memory
from solver.costs.schedule_time import (
    Timeline,
    schedule_timeline,
    simulate_schedule,
    simulated_iteration_ns,
    stages_iteration_ns,
    stages_timeline,
)
from solver.costs.stage_cost import MOMENTS, StageCost
from solver.costs.stages import PPM, placed_stage_costs, stage_costs, utilization_ppm
from solver.costs.states import (
    ParamShares,
    ddp_bucket_bytes,
    optimizer_step_bytes,
)
from solver.costs.times import (
    PipelineLinks,
    TimeViews,
    dp_overlap_of,
    pipeline_link_gb_per_s,
    pipeline_links,
    throughput,
)
from solver.costs.units import NS_PER_MS

__all__ = [
    "BoundTerm",
    "BoundaryTensors",
    "LayerCosts",
    "MAX_EXACT_BYTES",
    "MAX_ITERATION_NS",
    "MOMENTS",
    "NS_PER_MS",
    "PPM",
    "ParamShares",
    "PipelineLinks",
    "RING_BACKWARD_CHUNKS",
    "RoutedExperts",
    "ScheduleAction",
    "StageCost",
    "TimeViews",
    "Timeline",
    "bound_terms",
    "boundary_bytes",
    "boundary_copies",
    "check_exact_range",
    "check_expert_degree",
    "ddp_bucket_bytes",
    "direct_boundary_bytes",
    "direct_buffer_adjustments",
    "dp_overlap_of",
    "empirical_layer_costs",
    "expert_all_to_all_ns",
    "expert_stored_bytes",
    "forwards_before_first_backward",
    "graph_columns",
    "graph_totals",
    "in_flight_microbatches",
    "in_flight_vectors",
    "interleaved_schedule_groups",
    "iteration_bound_ns",
    "iteration_floor_ns",
    "largest_local_param",
    "layer_costs",
    "num_routed_experts",
    "optimizer_step_bytes",
    "pipeline_link_gb_per_s",
    "pipeline_links",
    "placed_stage_costs",
    "recomputable_layers",
    "ring_attention_bytes",
    "ring_attention_pass_ns",
    "ring_bytes_per_ns",
    "RankMemory",
    "rank_memory",
    "routed_experts",
    "routing_factor",
    "schedule_actions",
    "schedule_moments",
    "schedule_timeline",
    "simulate_schedule",
    "simulated_iteration_ns",
    "stage_boundary_copies",
    "stage_buffer_bytes",
    "stage_costs",
    "stages_iteration_ns",
    "stages_timeline",
    "throughput",
    "unsaved_output_bytes",
    "utilization_ppm",
]
