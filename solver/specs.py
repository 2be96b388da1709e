"""The planner's inputs and its configuration record: cluster, training options, parallel config.

Three inputs, as in Calculon: the graph (what is trained, ``solver.graph``), the :class:`Cluster`
(what it runs on) and the :class:`TrainingConfig` (batch, precision, search space, constraints).
A :class:`ParallelConfig` is one point of the search space; a plan is a config plus a split.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from solver.calibration import Calibration
from solver.checks import check_integer, check_real, count_text, is_int, require
from solver.errors import quote
from solver.files.jsonfile import check_name
from solver.parallel import (
    MAX_DEGREE,
    MAX_VIRTUAL_STAGES,  # noqa: F401 (the degrees' limits, listed with the others here)
    ZERO_BUBBLE_SCHEDULES,
    ParallelDims,
    check_degree,
    check_degree_choices,
    check_dims,
    check_expert_choices,
    check_pins,
    check_sequence_parallel_choice,
    check_zero_bubble,
    searched_schedules,
)
from solver.precision import (
    BYTE_FIELDS,
    DEFAULT_OPTIMIZER_IMPL,
    DEFAULT_PRECISION,
    OPTIMIZER_IMPLS,
    bytes_per_param,
    step_temporary_bytes_per_param,
)
from solver.precision import check_words as check_precision_words
from solver.reserve import NO_RESERVE, MemoryReserve

SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules (interleaved 1F1B is 1f1b with ``virtual_stages`` > 1)."""

RECOMPUTE_MODES = ("none", "full", "selective")
"""Recomputation of a concrete layout (:attr:`ParallelConfig.recompute`)."""
RECOMPUTE_CHOICES = (*RECOMPUTE_MODES, "auto")
"""What the search may be asked for (:attr:`TrainingConfig.recompute`): a mode, or auto."""
SEQUENCE_PARALLEL_CHOICES = ("off", "on", "auto")
"""Sequence parallelism the search may be asked for (:attr:`TrainingConfig.sequence_parallel`)."""


def default_sequence_parallel(runtime: str) -> str:
    """``TrainingConfig.sequence_parallel`` when None: auto, SP whenever tp > 1, on both
    runtimes: Megatron-LM recommends it and torchtitan turns it on with TP (the torch runtime
    counts eager torch's gathered inputs, ``sp_gathered_bytes``). The one place that default
    lives."""
    del runtime  # both runtimes default to auto; kept so the default can differ per runtime
    return "auto"


ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages over the data-parallel group."""
OBJECTIVES = ("memory", "throughput")
RUNTIMES = ("megatron", "torch")
"""Pipeline runtimes whose boundary buffers the cost model knows (``boundary_copies``)."""
GRAD_BYTES_PER_PARAM = {
    runtime: bytes_per_param(DEFAULT_PRECISION, "adam", runtime)[1] for runtime in RUNTIMES
}
"""Gradient bytes per parameter of bf16-mixed training on each runtime (``solver.precision``):
Megatron-LM's DistributedDataParallel accumulates bf16 training's gradients in an fp32
``main_grad`` buffer (``accumulate_allreduce_grads_in_fp32``: 4); torch keeps them in the
parameters' dtype (bf16: 2)."""
GRAD_LIFETIMES = ("persistent", "step")
"""When gradients exist (``TrainingConfig.grad_lifetime``): persistent, for the whole step (a
gradient buffer: Megatron's ``main_grad``, DDP's ``gradient_as_bucket_view`` buckets,
``zero_grad(set_to_none=False)``); step, from each layer's first backward of the step to the
optimizer step (``optimizer.zero_grad()``, torch's default ``set_to_none=True``)."""
DEFAULT_GRAD_LIFETIME = {"megatron": "persistent", "torch": "step"}
"""``TrainingConfig.grad_lifetime`` when None: megatron-core allocates ``main_grad`` in a buffer
for the run; torch users call ``optimizer.zero_grad()`` (``set_to_none=True`` since torch 2.0;
torchtitan does), so gradients are freed every step (docs/cost-model.md, "Gradient lifetime")."""
MEMORY_MODELS = ("analytic", "empirical")
MEMORY_OBJECTIVES = ("utilization", "absolute")
"""What "memory" minimises on a heterogeneous cluster: the largest stage peak / capacity of its
group (utilization) or the largest stage peak in bytes (absolute)."""

# Ranges of the inputs (docs/layer-graph.md, "Limits"). Far beyond any real cluster or job; they
# keep the cost model's int64 products exact together with the graph's limits (solver.graph) and
# make absurd values (1e30 bytes of GPU memory, infinite TFLOP/s) errors instead of answers.
# The degrees' limits (MAX_DEGREE, MAX_VIRTUAL_STAGES) are solver.parallel's.
MAX_GPUS = 2**32
"""GPUs in a cluster: refuses absurd counts such as 2^64 (what a large count costs to search is
the time limit's business)."""
MAX_GPU_MEMORY_BYTES = 2**50
"""Memory per GPU, at most 1 PiB."""
MAX_GPUS_PER_NODE = 1024
GPU_TFLOPS_RANGE = (1e-6, 1e6)
"""Peak TFLOP/s per GPU: 1 MFLOP/s to 1 EFLOP/s."""
GB_PER_S_RANGE = (1e-3, 1e6)
"""Link bandwidth per GPU, GB/s: 1 MB/s to 1 PB/s."""
MAX_P2P_LATENCY_US = 1e6
"""Latency of one pipeline send, us: at most a second."""
MAX_GLOBAL_BATCH = 2**24
"""Samples per step (also bounds micro-batch sizes and dp * b * m of a config)."""
MAX_BYTES_PER_PARAM = 256
"""Bytes per parameter for weights, gradients or optimizer state (fp32 Adam: 12)."""
MAX_SLOWDOWN = 1000.0
"""Largest max_slowdown (use None for no limit): 1000 times the fastest iteration stays inside
the cost model's exact range (``costs.MAX_ITERATION_NS``)."""
MAX_BUDGET_NS = 2**62
"""Longest iteration a min_throughput may allow, ns (with the global batch: its lower bound)."""
MAX_CAPACITY_FACTOR = 1024.0
"""Largest ``TrainingConfig.moe_capacity_factor`` (each expert takes at most this many times its
balanced share of the tokens; real runs use 1 to 2)."""
MOE_DROPLESS = "dropless"
"""``TrainingConfig.moe_capacity_factor`` of a dropless router (the worst case it can reach)."""


@dataclass(kw_only=True, frozen=True)
class NodeGroup:
    """Identical nodes of a heterogeneous cluster (``solver.files.cluster_file``,
    docs/cluster.md)."""

    name: str
    """Shown in plans (e.g. "a100-40g")."""
    num_nodes: int
    """Nodes in the group."""
    gpus_per_node: int
    """GPUs per node; tensor parallelism stays inside a node."""
    gpu_memory_bytes: int
    """Memory per GPU usable for training, bytes."""
    gpu_flops: float
    """Peak dense FLOP/s per GPU at the training precision."""
    flops_efficiency: float = 0.5
    """Fraction of gpu_flops reached by layer kernels."""
    intra_node_gb_per_s: float = 450.0
    """Per-GPU, per-direction bandwidth inside a node, GB/s."""
    inter_node_gb_per_s: float = 50.0
    """Per-GPU, per-direction bandwidth across nodes, GB/s."""
    memory_gb_per_s: float = 3350.0
    """GPU memory bandwidth, GB/s."""
    p2p_latency_us: float = 0.0
    """Latency of one pipeline send, us."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name),
            f"name must be a non-empty string, got {quote(self.name)}",
        )
        check_name(self.name, "node group", what="name")
        check_integer("num_nodes", self.num_nodes, 1, MAX_DEGREE)
        _check_hardware(self)

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """Homogeneous GPUs. Defaults describe an H100-SXM node with 8 GPUs and 400 Gb/s InfiniBand.

    A heterogeneous cluster lists its node ``groups`` (two or more); the scalar fields then
    describe the whole cluster only loosely (num_gpus is the total, gpu_memory_bytes the largest
    capacity) and every cost uses the group a stage is placed on (:meth:`group_cluster`)."""

    num_gpus: int
    """GPUs in the job."""
    gpu_memory_bytes: int = 80 * 2**30
    """Memory per GPU usable for training, bytes (stage peaks must stay at or below it)."""
    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism stays inside a node."""
    gpu_flops: float = 989e12
    """Peak dense FLOP/s per GPU at the training precision (H100 SXM bf16)."""
    flops_efficiency: float = 0.5
    """Fraction of gpu_flops reached by layer kernels (model FLOPs utilisation)."""
    intra_node_gb_per_s: float = 450.0
    """Per-GPU, per-direction bandwidth inside a node, GB/s (NVLink 4: 900 GB/s bidirectional)."""
    inter_node_gb_per_s: float = 50.0
    """Per-GPU, per-direction bandwidth across nodes, GB/s (400 Gb/s InfiniBand)."""
    memory_gb_per_s: float = 3350.0
    """GPU memory (HBM) bandwidth, GB/s (H100 SXM: 3.35 TB/s): the optimizer step's time when
    the graph has no profiled one (``costs._optimizer_step_ns``)."""
    p2p_latency_us: float = 0.0
    """Latency of one pipeline send between two ranks, us, added to its bytes / bandwidth in the
    schedule simulation (``solver.costs.schedule_time``); 0 by default (NCCL within a node: ~10 us,
    negligible beside a stage's milliseconds; gloo on CPU: hundreds of us, measure it)."""
    groups: tuple[NodeGroup, ...] = ()
    """Node groups of a heterogeneous cluster (empty: homogeneous)."""

    @property
    def is_heterogeneous(self) -> bool:
        return len(self.groups) > 1

    def group_cluster(self, group: int) -> Cluster:
        """Group ``group`` as a homogeneous cluster (its own GPU count, memory, FLOP/s, links)."""
        spec = self.groups[group]
        return Cluster(
            num_gpus=spec.num_gpus,
            gpu_memory_bytes=spec.gpu_memory_bytes,
            gpus_per_node=spec.gpus_per_node,
            gpu_flops=spec.gpu_flops,
            flops_efficiency=spec.flops_efficiency,
            intra_node_gb_per_s=spec.intra_node_gb_per_s,
            inter_node_gb_per_s=spec.inter_node_gb_per_s,
            memory_gb_per_s=spec.memory_gb_per_s,
            p2p_latency_us=spec.p2p_latency_us,
        )

    def __post_init__(self) -> None:
        if self.groups:
            require(
                self.num_gpus == sum(g.num_gpus for g in self.groups),
                f"num_gpus({self.num_gpus}) != GPUs of the groups "
                f"({sum(g.num_gpus for g in self.groups)})",
            )
        check_integer("num_gpus", self.num_gpus, 1, MAX_GPUS)
        _check_hardware(self)


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    """What is trained and how the search may vary it.

    The candidate lists (micro-batch sizes, ZeRO stages, recompute, virtual stages) and the pins
    describe the search space; each :class:`ParallelConfig` the search builds is one concrete
    point of it and is the home of that layout's schedule, recompute mode and virtual stages.
    """

    global_batch: int
    """Samples per optimizer step (B)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Candidate micro-batch sizes b (samples); m = B / (dp * b) must be a whole number."""
    zero_stages: tuple[int, ...] = (0,)
    """Candidate ZeRO stages; (0, 1, 2, 3) is what --zero auto searches."""
    recompute: str = "none"
    """none | full (every layer recomputes) | selective (the solver chooses the recomputed layers
    jointly with the split) | auto (= selective: none and full are special cases of it, so its
    optimum is never worse than either; none and full with the empirical memory model)."""
    schedule: str = "1f1b"
    """Pipeline schedules searched: 1f1b, gpipe (``SCHEDULES``) or a split-backward schedule
    (``ZERO_BUBBLE_SCHEDULES``: interleaved-zb, zbv, dualpipev), a comma list of them, or auto
    (all; ``schedules``). A (schedule, pp, v, m) the schedule cannot run is skipped
    (``parallel.schedule_refusal``)."""
    virtual_stages: tuple[int, ...] = (1,)
    """Candidate model chunks per pipeline rank v (interleaved 1F1B when v > 1; Megatron-LM's
    ``--num-virtual-stages-per-pipeline-rank``); (1, 2, 4) lets the search choose."""
    precision: str | None = None
    """fp32 | bf16 | bf16-mixed | fp16-mixed (``solver.precision.PRECISIONS``): with the
    optimizer and the runtime, it gives the bytes per parameter (``solver.precision``'s table).
    None: the graph's dtype decides when plan/evaluate get the graph (``precision.for_graph``:
    fp32 -> fp32, bf16 -> bf16-mixed, fp16 -> fp16-mixed); until then bf16-mixed."""
    optimizer: str = "adam"
    """adam | adamw | lion | sgd-momentum | sgd (``solver.precision.OPTIMIZERS``): its state
    tensors per parameter (2, 2, 1, 1, 0)."""
    weight_bytes_per_param: int | None = None
    """Bytes per parameter for weights; None: the table's for precision, optimizer and runtime
    (2 for bf16-mixed). A value given here (``--bytes-per-param``) wins over the table."""
    grad_bytes_per_param: int | None = None
    """Bytes per parameter for gradients; None: the table's (bf16-mixed: 4 on megatron, its fp32
    ``main_grad``; 2 on torch). Resolved when the config is made, so
    ``dataclasses.replace(config, runtime=...)`` keeps it unless given None again."""
    optimizer_bytes_per_param: int | None = None
    """Bytes per parameter for optimizer state; None: the table's (bf16-mixed Adam: 12, fp32
    master + two moments)."""
    bytes_from_table: frozenset[str] = field(
        default=frozenset(), init=False, compare=False, repr=False
    )
    """The byte fields the table filled (the others were given); set by the config itself."""
    pp: int | None = None
    """Pin the pipeline degree (None: search)."""
    tp: int | None = None
    """Pin the tensor-parallel degree (None: search)."""
    dp: int | None = None
    """Pin the data-parallel degree (None: search)."""
    cp: tuple[int, ...] = (1,)
    """Candidate context-parallel degrees c (Megatron-LM's ``--context-parallel-size``; each
    sequence split over c GPUs, pp x tp x cp x dp GPUs); (1, 2, 4) lets the search choose, one
    value pins it. c must divide the graph's sequence length
    (``parallel.check_context_parallel``)."""
    ep: tuple[int, ...] | None = None
    """Candidate expert-parallel degrees (Megatron's ``--expert-model-parallel-size``); each
    config takes those that divide its dp (the experts are sharded within the data-parallel
    ranks). None (auto): every ep dividing both the graph's routed experts and dp on a
    mixture-of-experts graph, 1 on a dense one (``candidates.expert_parallel_degrees``)."""
    moe_capacity_factor: float | str = 1.0
    """Routing factor f of the routed experts' activations and all-to-alls (``solver.costs``):
    a float c >= 1, each expert takes at most c times its balanced share of the tokens (Megatron's
    ``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``: padded to c,
    so f = c; 1.0, the default, is a balanced routing), or "dropless": the most a dropless
    router can send one GPU, f = ep min(k, E / ep) / k (``costs.routing_factor``)."""
    min_throughput: float | None = None
    """Samples/s the plan must reach; overrides max_slowdown when set."""
    max_slowdown: float | None = 1.25
    """Plan may be at most this many times slower than the fastest plan that fits (None: off)."""
    objective: str = "memory"
    """memory: minimise the largest per-GPU peak; throughput: fastest plan that fits."""
    memory_model: str = "analytic"
    """analytic: the cost model's terms; empirical: the graph's per-layer mem_isolated/mem_added
    statistics (mCAP/CAPSlog): a stage holds mem_isolated of its first layer + mem_added of the
    others. Pipeline-only configurations (tp = dp = 1) of chain graphs."""
    runtime: str = "megatron"
    """Pipeline runtime the plan is for: megatron (Megatron-LM / DeepSpeed: one receive buffer per
    direction) or torch (torch.distributed.pipelining: one per micro-batch, kept for the run)."""
    deallocate_pipeline_outputs: bool = True
    """megatron runtime: a sent pipeline output's data is freed at once (Megatron-LM's argument
    parsing sets this); False (megatron-core's ``TransformerConfig`` default) keeps the outputs of
    a stage's in-flight micro-batches until their backward. The torch runtime ignores it (it
    keeps them)."""
    sequence_parallel: str | None = None
    """Megatron's sequence parallelism (Korthikanti et al. 2022) for the candidates with tp > 1:
    off (none), on (every such candidate; a pinned tp of 1 is an error) or auto (the same
    candidates without that error: SP whenever tp > 1, as Megatron-LM recommends). It splits the
    activations TP leaves replicated, so it never costs memory. None: the runtime's
    (:func:`default_sequence_parallel`: auto on megatron, off on torch), resolved when the config
    is made like ``grad_lifetime``."""
    memory_objective: str = "utilization"
    """Heterogeneous clusters only: utilization (minimise max stage peak / its group's capacity,
    in parts per million, rounded up) or absolute (max stage peak, bytes). A homogeneous cluster
    always minimises bytes (the same plans: the capacity is one constant)."""
    calibration: Calibration | None = None
    """Scales per memory component and a constant per GPU fitted to real runs
    (``solver.calibration``, ``python -m profiling.calibrate``); None: the analytic model alone.
    Hashable and compared on its scales and constant only, so this config stays hashable."""
    reserve: MemoryReserve | None = None
    """Memory per GPU the job never gets (CUDA context, NCCL buffers, cuBLAS workspaces,
    fragmentation): every peak must fit in capacity - reserve (``solver.reserve``). None: no
    reserve, the API's historical meaning of ``Cluster.gpu_memory_bytes`` (memory usable for
    training). The CLIs pass ``reserve.default_reserve(calibration)`` unless --reserve is
    given: ``DEFAULT_RESERVE`` (1 GiB + 5%), or none under a calibration with a per-GPU
    constant; pass the same here to plan as the CLIs do."""

    grad_lifetime: str | None = None
    """When gradients exist (``GRAD_LIFETIMES``): persistent (all step: a gradient buffer,
    Megatron's ``main_grad``, DDP buckets, ``zero_grad(set_to_none=False)``) or step
    (``optimizer.zero_grad()`` with torch's default ``set_to_none=True``: each layer's gradients
    appear at its first backward of the step). None: the runtime's (``DEFAULT_GRAD_LIFETIME``:
    persistent on megatron, step on torch), resolved when the config is made like
    ``grad_bytes_per_param``. On the torch runtime DDP (dp > 1, ZeRO 0 or 1) keeps gradients in
    its buckets, so the cost model counts them persistent there whatever this says."""
    optimizer_impl: str | None = None
    """How the optimizer step runs (``solver.precision.OPTIMIZER_IMPLS``): foreach (torch.optim's
    multi-tensor kernels, its default on a GPU: Adam's step makes a state-sized temporary of every
    parameter at once, ``optimizer_step_bytes_per_param``) or fused (``fused=True``,
    TransformerEngine/apex FusedAdam: in place). None: the runtime's
    (``DEFAULT_OPTIMIZER_IMPL``: fused on megatron, foreach on torch), resolved when the config is
    made."""

    @property
    def optimizer_step_bytes_per_param(self) -> int:
        """Bytes per parameter of the optimizer step's temporary (``solver.precision``: 4 for a
        foreach Adam with fp32 states, 0 fused)."""
        return step_temporary_bytes_per_param(
            self.precision or DEFAULT_PRECISION, self.optimizer, self.optimizer_impl
        )

    @property
    def memory_reserve(self) -> MemoryReserve:
        """The reserve in force: the given one, else none."""
        return NO_RESERVE if self.reserve is None else self.reserve

    def usable_bytes(self, capacity_bytes: int) -> int:
        """The memory a stage may fill on a GPU of ``capacity_bytes``: capacity - reserve."""
        return self.memory_reserve.usable_bytes(capacity_bytes)

    def __post_init__(self) -> None:
        """Check every field in a fixed order (the first problem is the error) and resolve the
        fields whose None means "the table's" or "the runtime's"."""
        self._check_search_space()
        self._check_runtime()
        self._resolve_bytes_per_param()
        self._resolve_optimizer_and_gradients()
        self._check_objectives()
        for name in ("weight_bytes_per_param", "grad_bytes_per_param", "optimizer_bytes_per_param"):
            check_integer(name, getattr(self, name), 0, MAX_BYTES_PER_PARAM)
        check_pins({"pp": self.pp, "tp": self.tp, "dp": self.dp})
        self._check_experts()
        self._check_speed_limits()
        self._check_attachments()

    def _check_search_space(self) -> None:
        """The batch and the candidate lists: micro-batch sizes, ZeRO stages, recompute,
        virtual stages, cp degrees, schedule."""
        check_integer("global_batch", self.global_batch, 1, MAX_GLOBAL_BATCH)
        require(
            bool(self.micro_batch_sizes)
            and all(is_int(b) and 1 <= b <= MAX_GLOBAL_BATCH for b in self.micro_batch_sizes),
            f"micro_batch_sizes must be integers in 1..{count_text(MAX_GLOBAL_BATCH)}, got "
            f"{quote(self.micro_batch_sizes)}",
        )
        require(
            bool(self.zero_stages) and all(z in ZERO_STAGES for z in self.zero_stages),
            f"zero_stages must be within 0..3, got {self.zero_stages}",
        )
        require(
            self.recompute in RECOMPUTE_CHOICES,
            f"recompute must be one of {RECOMPUTE_CHOICES}, got {quote(self.recompute)}",
        )
        check_degree_choices("virtual_stages", self.virtual_stages)
        check_degree_choices("cp", self.cp)
        searched_schedules(self.schedule)  # one name, a comma list or auto
        require(
            self.schedule != "gpipe" or self.virtual_stages == (1,),
            f"virtual stages {self.virtual_stages} need the 1f1b schedule (interleaved 1F1B), "
            f"got {quote(self.schedule)}",
        )

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules the search takes (``parallel.searched_schedules``)."""
        return searched_schedules(self.schedule)

    def _check_runtime(self) -> None:
        """Memory model, runtime, output deallocation and sequence parallelism (its None
        resolved to the runtime's default)."""
        require(
            self.memory_model in MEMORY_MODELS,
            f"memory_model must be one of {MEMORY_MODELS}, got {quote(self.memory_model)}",
        )
        require(
            self.runtime in RUNTIMES,
            f"runtime must be one of {RUNTIMES}, got {quote(self.runtime)}",
        )
        require(
            isinstance(self.deallocate_pipeline_outputs, bool),
            f"deallocate_pipeline_outputs must be True or False, got "
            f"{quote(self.deallocate_pipeline_outputs)}",
        )
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", default_sequence_parallel(self.runtime))
        require(
            self.sequence_parallel in SEQUENCE_PARALLEL_CHOICES,
            f"sequence_parallel must be one of {SEQUENCE_PARALLEL_CHOICES}, got "
            f"{quote(self.sequence_parallel)}",
        )
        check_sequence_parallel_choice(self.sequence_parallel, self.tp)

    def _resolve_bytes_per_param(self) -> None:
        """The byte fields left None take the table's value for the precision, optimizer and
        runtime (``solver.precision``); ``bytes_from_table`` records which did."""
        check_precision_words(self.precision or DEFAULT_PRECISION, self.optimizer)
        table = bytes_per_param(self.precision or DEFAULT_PRECISION, self.optimizer, self.runtime)
        filled = frozenset(name for name in BYTE_FIELDS if getattr(self, name) is None)
        # frozen: the table's bytes are set once, here
        for name, value in zip(BYTE_FIELDS, table, strict=True):
            if name in filled:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "bytes_from_table", filled)

    def _resolve_optimizer_and_gradients(self) -> None:
        """grad_lifetime and optimizer_impl: None is the runtime's default; megatron keeps its
        gradients persistent."""
        if self.grad_lifetime is None:
            object.__setattr__(self, "grad_lifetime", DEFAULT_GRAD_LIFETIME[self.runtime])
        if self.optimizer_impl is None:
            object.__setattr__(self, "optimizer_impl", DEFAULT_OPTIMIZER_IMPL[self.runtime])
        require(
            self.optimizer_impl in OPTIMIZER_IMPLS,
            f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {quote(self.optimizer_impl)}",
        )
        require(
            self.grad_lifetime in GRAD_LIFETIMES,
            f"grad_lifetime must be one of {GRAD_LIFETIMES}, got {quote(self.grad_lifetime)}",
        )
        require(
            self.runtime == "torch" or self.grad_lifetime == "persistent",
            f"grad_lifetime {quote(self.grad_lifetime)} with runtime megatron: megatron-core "
            "keeps gradients in its main_grad buffer for the whole run; use --grad-lifetime "
            "persistent or --runtime torch",
        )

    def _check_objectives(self) -> None:
        """objective and memory_objective are among their words."""
        require(
            self.objective in OBJECTIVES,
            f"objective must be one of {OBJECTIVES}, got {quote(self.objective)}",
        )
        require(
            self.memory_objective in MEMORY_OBJECTIVES,
            f"memory_objective must be one of {MEMORY_OBJECTIVES}, got "
            f"{quote(self.memory_objective)}",
        )

    def _check_experts(self) -> None:
        """ep: None or a non-empty tuple of degrees; moe_capacity_factor: "dropless" or a
        number in 1..MAX_CAPACITY_FACTOR."""
        check_expert_choices(self.ep)
        factor = self.moe_capacity_factor
        if factor != MOE_DROPLESS:
            require(
                isinstance(factor, numbers.Real)
                and not isinstance(factor, bool)
                and 1 <= factor <= MAX_CAPACITY_FACTOR,
                f"moe_capacity_factor must be a number in 1..{MAX_CAPACITY_FACTOR:g} or "
                f'"dropless", got {quote(factor)}',
            )

    def _check_speed_limits(self) -> None:
        """min_throughput allows an iteration of 1 ns to 2^62 ns; max_slowdown within
        1..MAX_SLOWDOWN."""
        if self.min_throughput is not None:
            check_real("min_throughput", self.min_throughput, 0, None, low_open=True)
            # the iteration it allows, B / min_throughput, from 1 ns to 2^62 ns
            low = self.global_batch * 1e9 / MAX_BUDGET_NS
            high = self.global_batch * 1e9
            require(
                low <= self.min_throughput <= high,
                f"min_throughput must be within {low:.3g}..{high:.3g} samples/s with global_batch "
                f"{self.global_batch} (an iteration of 1 ns to 2^62 ns), got "
                f"{self.min_throughput:.4g}",
            )
        if self.max_slowdown is not None:
            check_real(
                "max_slowdown", self.max_slowdown, 1, MAX_SLOWDOWN, note="1: only the fastest plans"
            )

    def _check_attachments(self) -> None:
        """reserve and calibration are of their classes (or None)."""
        require(
            self.reserve is None or isinstance(self.reserve, MemoryReserve),
            f"reserve must be a solver.reserve.MemoryReserve or None, got "
            f"{type(self.reserve).__name__}",
        )
        require(
            self.calibration is None or isinstance(self.calibration, Calibration),
            f"calibration must be a solver.calibration.Calibration or None, got "
            f"{type(self.calibration).__name__}",
        )


@dataclass(kw_only=True, frozen=True, order=True)
class ParallelConfig:
    """One point of the search space: how the job is laid out on the GPUs."""

    pp: int
    """Pipeline stages p."""
    tp: int
    """Tensor-parallel degree t."""
    dp: int
    """Data-parallel degree d."""
    micro_batch: int
    """Micro-batch size b, samples."""
    num_microbatches: int
    """Micro-batches per step per data-parallel replica, m = B / (d * b)."""
    zero: int = 0
    """ZeRO stage 0..3 over the data-parallel group."""
    recompute: str = "none"
    """none | full: every layer recomputes | selective: each layer may (the plan says which);
    ``RECOMPUTE_MODES``."""
    schedule: str = "1f1b"
    """1f1b | gpipe (``SCHEDULES``) | interleaved-zb | zbv | dualpipev (torch's split-backward
    schedules, ``ZERO_BUBBLE_SCHEDULES``)."""
    virtual_stages: int = 1
    """v: model chunks per pipeline rank (interleaved 1F1B, Megatron's virtual pipeline size);
    the layers are split into p v virtual stages and virtual stage j runs on rank j mod p
    (zbv, dualpipev: v = 2 in a V, rank r runs virtual stages r and 2p - 1 - r)."""
    sp: bool = False
    """Sequence parallelism (Megatron's ``--sequence-parallel``, needs tp > 1): the activations
    TP leaves replicated (norms, dropout, residuals) and the tensors sent between stages are
    split along the sequence over the t ranks too."""
    cp: int = 1
    """Context-parallel degree c (Megatron's ``--context-parallel-size``): each sequence is split
    over c GPUs, ring attention passes the keys and values around; pp x tp x cp x dp GPUs."""
    ep: int = 1
    """Expert-parallel degree e (Megatron's ``--expert-model-parallel-size``): the routed experts
    are sharded over e of the data-parallel ranks (e divides dp)."""

    def __post_init__(self) -> None:
        for name in (
            "pp",
            "tp",
            "cp",
            "dp",
            "ep",
            "micro_batch",
            "num_microbatches",
            "virtual_stages",
        ):
            check_degree(name, getattr(self, name))
        require(
            self.dp * self.micro_batch * self.num_microbatches <= MAX_GLOBAL_BATCH,
            f"dp({self.dp}) * micro_batch({self.micro_batch}) * num_microbatches"
            f"({self.num_microbatches}) = {self.dp * self.micro_batch * self.num_microbatches} "
            f"samples per step, over the limit {count_text(MAX_GLOBAL_BATCH)}",
        )
        require(self.zero in ZERO_STAGES, f"zero must be one of 0..3, got {quote(self.zero)}")
        require(
            self.recompute in RECOMPUTE_MODES,
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {quote(self.recompute)}",
        )
        known = SCHEDULES + ZERO_BUBBLE_SCHEDULES
        require(
            self.schedule in known,
            f"schedule must be one of {', '.join(known)}, got {quote(self.schedule)}",
        )
        if self.schedule in ZERO_BUBBLE_SCHEDULES:  # torch's own rules for its schedules
            check_zero_bubble(self.schedule, self.num_microbatches, self.pp, self.virtual_stages)
        require(
            self.virtual_stages == 1 or self.schedule != "gpipe",
            f"virtual_stages={self.virtual_stages} with schedule {quote(self.schedule)}: "
            "interleaved pipelines run 1F1B; use --schedule 1f1b",
        )
        check_dims(self)  # sp only with tp > 1, ep | dp

    @cached_property
    def dims(self) -> ParallelDims:
        """The layout's degrees (``solver.parallel``: products, derived groups, rules)."""
        return ParallelDims(
            pp=self.pp,
            tp=self.tp,
            cp=self.cp,
            dp=self.dp,
            ep=self.ep,
            virtual_stages=self.virtual_stages,
            sp=self.sp,
        )

    @property
    def num_gpus(self) -> int:
        """GPUs the layout uses, pp x tp x cp x dp (``ParallelDims.num_gpus``)."""
        return self.dims.num_gpus

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """Short text such as 'pp4 tp2 dp2 b1 m16 zero0 1f1b' (' sp' last with sequence
        parallelism; 'cp2' after tp and 'ep4' after dp when above 1)."""
        v = self.virtual_stages
        schedule = self.schedule if v == 1 else f"interleaved-1f1b v{v}"
        if self.schedule in ZERO_BUBBLE_SCHEDULES:
            schedule = self.schedule if v == 1 else f"{self.schedule} v{v}"
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        text = (
            f"pp{self.pp} tp{self.tp}{cp} dp{self.dp}{ep} b{self.micro_batch} "
            f"m{self.num_microbatches} zero{self.zero} {schedule}"
        )
        suffix = {"full": " recompute", "selective": " selective-recompute"}
        return text + suffix.get(self.recompute, "") + (" sp" if self.sp else "")


@dataclass(kw_only=True)
class SearchStatus:
    """One search over the configs of a planning call (``solver.search.config_search.search``)."""

    name: str
    """"fastest plan" (objective time) or "smallest peak" (objective memory)."""
    role: str
    """What it was for: "answer" (the plan's objective) or "max-slowdown budget" (the fastest
    plan that sets the iteration budget of the smallest-peak search)."""
    wall_s: float
    """Wall time of the search, incumbent pass included (s)."""
    incumbent_s: float
    """Wall time of its incumbent pass (quick splits of every config, s)."""
    proven: bool
    """Every config solved to optimality, closed by its quick split, or pruned by bounds."""
    time_limit_reached: bool
    """The planning call's time limit passed during this search."""
    configs_open: int = 0
    """Configs left open with a lower bound below the best value found (why not proven)."""
    configs_with_incumbent: int = 0
    """Configs the incumbent pass gave a feasible quick split."""
    configs_closed_by_incumbent: int = 0
    """Configs whose quick split met their lower bound (optimal without an exact solve)."""


@dataclass(kw_only=True)
class SolverReport:
    """How a plan was found: backend, status, objective and proven bound, wall time."""

    backend: str
    status: str
    """OPTIMAL (proven), FEASIBLE (time limit hit; see gap), INFEASIBLE, UNKNOWN."""
    objective: float
    bound: float
    wall_s: float
    configs_total: int = 0
    configs_solved: int = 0
    configs_pruned: int = 0
    notes: list[str] = field(default_factory=list)
    time_limit_reached: bool = False
    """The time limit passed before planning ended (a search or the tie-break was cut)."""
    searches: list[SearchStatus] = field(default_factory=list)
    """Each search that ran, in order, with its time and proof status."""

    @property
    def gap(self) -> float:
        """Relative gap (objective - bound) / objective; 0 when proven optimal."""
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


def _check_hardware(spec: Cluster | NodeGroup) -> None:
    """The fields a Cluster and a NodeGroup share: within their ranges (module constants)."""
    check_integer("gpu_memory_bytes", spec.gpu_memory_bytes, 1, MAX_GPU_MEMORY_BYTES)
    check_integer("gpus_per_node", spec.gpus_per_node, 1, MAX_GPUS_PER_NODE)
    low, high = GPU_TFLOPS_RANGE
    check_real("gpu_flops", spec.gpu_flops, low * 1e12, high * 1e12)
    check_real("flops_efficiency", spec.flops_efficiency, 0, 1, low_open=True)
    for name in ("intra_node_gb_per_s", "inter_node_gb_per_s", "memory_gb_per_s"):
        check_real(name, getattr(spec, name), *GB_PER_S_RANGE)
    check_real("p2p_latency_us", spec.p2p_latency_us, 0, MAX_P2P_LATENCY_US)
