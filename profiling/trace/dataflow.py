"""Dataflow tracing for the profiler: one forward + backward seen op by op.

:class:`Tracer` is a ``TorchDispatchMode`` that sits above ``FakeTensorMode`` (or runs on real
tensors) and keeps one :class:`StorageRecord` per tensor storage. Records are keyed by the
storage's identity (``Tensor.untyped_storage()``, whose Python object PyTorch preserves for as
long as the storage lives), so views and in-place updates of one buffer share a record. A record
holds:

- ``provenance``: the selected layer whose forward produced the data, as a set. A storage
  created while layer L's forward runs gets ``{L}``; one created (or updated in place, or viewed)
  by glue code outside every layer from layers' data belongs to the glue's owner (below), the
  stage ``torch.distributed.pipelining.pipeline`` runs that glue in and sends the result from;
  everything a layer returns is re-tagged ``{L}``. Tensors that glue after a layer makes from
  the model inputs or buffers alone (Llama's rotary ``cos``/``sin``, computed once after the
  embedding and read by every block) belong to that owner too; those made before any layer
  (position ids from the inputs) have none. Edges, each naming the storage it carries: an
  input of layer L that L's ops read gives ``src -> L`` (one it is given but never reads, such
  as position ids passed to every block, is no edge: ``pipeline()`` does not send it); glue
  reading a tensor of another layer gives ``src -> owner``. So HuggingFace GPT-2's
  ``inputs_embeds + position_embeds`` (run after ``wpe``) gives ``wte -> wpe`` and
  ``wpe -> h.0``, the tensors ``pipeline()`` sends, and one tensor read by several layers
  (T5's encoder output) is one storage on several edges.
- ``taint``: the column-parallel Linear calls the data derives from (see ``tensor_parallel.py``).
- allocation and release events, from which :meth:`Tracer.transients` computes each layer's
  transient peak.

Owners. Every op, saved tensor and allocation is charged to an *owner* (a layer index): during
the forward, the layer whose forward is running; for glue code outside every layer, the layer that
finished last (the stage a ``torch.distributed.pipelining`` split at the *beginning* of each layer
would run it in), or, before any layer has run, the first layer (``PENDING``, resolved at the
end). During the backward, the owner is that of the autograd node being executed
(``torch._C._current_autograd_node()``); nodes get their owner in the forward, by walking the
autograd graph from a layer's outputs when it returns (new nodes -> that layer) and from its inputs
when it starts (new nodes -> the glue owner).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from profiling._torch_compat import (
    TorchDispatchMode,
    cpu_flash_attention,
    cpu_flash_attention_backward,
    current_autograd_node,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    tree_leaves,
)

PENDING = -1
"""Owner of glue code that runs before the first layer; resolved to the first layer."""

_IGNORED_OPS = {torch.ops.prim.device.default}

_FLOP_FRACTION = contextvars.ContextVar("attention_flop_fraction", default=1.0)


def current_flop_fraction() -> float:
    """The fraction the attention kernels' FLOPs are counted at (1 outside a window)."""
    return _FLOP_FRACTION.get()


@contextlib.contextmanager
def attention_flop_fraction(fraction: float):
    """Count the attention kernels' FLOPs called within it times ``fraction`` (0 < f <= 1)."""
    token = _FLOP_FRACTION.set(fraction)
    try:
        yield
    finally:
        _FLOP_FRACTION.reset(token)


def _cpu_flash_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """torch's SDPA count (every q-k pair), times the sliding window's fraction of the pairs."""
    flops = sdpa_flop_count(query.shape, key.shape, value.shape)
    return round(flops * current_flop_fraction())


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    flops = sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    return round(flops * current_flop_fraction())


def _windowed(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` times :func:`current_flop_fraction` (a sliding window's share of the pairs)."""

    def counted(*args, **kwargs) -> int:
        return round(formula(*args, **kwargs) * current_flop_fraction())

    return counted


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    # the GPU's attention kernels (a profile on CUDA), windowed as the CPU ones
    **{op: _windowed(f) for op, f in flop_registry.items() if "_attention" in str(op)},
    # FlopCounterMode has no formula for the CPU flash-attention kernels that SDPA picks on CPU;
    # they do the same work as the CUDA ones.
    cpu_flash_attention: _cpu_flash_flops,
    cpu_flash_attention_backward: _cpu_flash_backward_flops,
}
"""FLOP formulas by op, those of ``torch.utils.flop_counter`` (matmuls, convolutions,
attention); other ops (elementwise, norms, softmax) count zero, as in ``FlopCounterMode``."""


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for tensors without one (sparse, nested, wrappers)."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def tensors_in(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


@dataclass(kw_only=True)
class StorageRecord:
    """What the tracer knows about one storage."""

    uid: int
    nbytes: int
    kind: str
    """``activation`` (made by the run), ``param``, ``buffer`` or ``input``."""
    tracked: bool
    """Allocated by an op during the run: counts as live memory until released."""
    provenance: frozenset[int] = frozenset()
    taint: frozenset[int] = frozenset()
    vocab: int | None = None
    """The vocabulary tag (``Tracer.vocab_rows``) of a vocabulary-sized tensor: an LM-head
    candidate's output, or made from a tagged tensor with the vocabulary as its last dimension
    (the fp32 logits, the softmax, their gradients; not the gradient of the head's input)."""
    name: str | None = None
    """Parameter name (for parameters)."""
    first_user: int | None = None
    """For parameters and model inputs: the owner of the first op that read it."""
    ref: Any = None


@dataclass(kw_only=True)
class LayerRecord:
    """Batch totals for one owner (bytes and FLOPs of the whole profiled batch)."""

    calls: int = 0
    first_call: int | None = None
    saved: list[tuple[int, frozenset[int]]] = field(default_factory=list)
    """(storage bytes, taint at save time) per storage first saved by this layer."""
    glue_saved_bytes: int = 0
    vocab_saved: list[tuple[int, int]] = field(default_factory=list)
    """(storage bytes, vocabulary tag) of the vocabulary-sized part of ``saved``."""
    expert_saved: list[tuple[int, frozenset[int]]] = field(default_factory=list)
    """The part of ``saved`` first saved by ops inside a routed-experts module
    (``Tracer.in_experts``; ``experts.py``)."""
    output_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    outputs: dict[int, int] = field(default_factory=dict)
    """Storage uid -> bytes of the tensors the layer's last forward call returned."""
    in_edges: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    """(source layer, storage uid) -> bytes of that tensor read at this layer's forward calls,
    or, for glue this layer owns, read by that glue (once)."""

    @property
    def saved_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.saved)

    def absorb(self, other: LayerRecord) -> None:
        """Add ``other`` (the glue that ran before the first layer) to this record."""
        self.saved += other.saved
        self.vocab_saved += other.vocab_saved
        self.expert_saved += other.expert_saved
        self.glue_saved_bytes += other.glue_saved_bytes
        self.fwd_flops += other.fwd_flops
        self.bwd_flops += other.bwd_flops


def assign_nodes(
    roots: Iterable[torch.Tensor],
    owner: int,
    node_owner: dict[Any, int],
    on_new: Callable[[Any, int], None] | None = None,
) -> None:
    """Give ``owner`` to every autograd node reachable from ``roots`` that has none yet."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in node_owner:
            continue
        node_owner[node] = owner
        if on_new is not None:
            on_new(node, owner)
        stack.extend(child for child, _ in node.next_functions if child is not None)


class CudaLikeDropout(TorchFunctionMode):
    """Route ``F.dropout`` through ``torch.native_dropout``, the fused kernel CUDA uses.

    On CPU, ``F.dropout`` is a composite that multiplies by a noise tensor of the input's dtype and
    saves it (2 bytes per element in bf16); on CUDA the fused kernel saves a one-byte bool mask.
    The planner sizes GPU runs, so the profile follows CUDA. Values are distributed alike.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False)) | kwargs
            x, p = bound["input"], float(bound.get("p", 0.5))
            if bound.get("training", True) and 0.0 < p < 1.0 and x.numel() > 0:
                out = torch.native_dropout(x, p, True)[0]
                return x.copy_(out) if bound.get("inplace", False) else out
        return func(*args, **kwargs)


class Tracer(TorchDispatchMode):
    """Records saved tensors, outputs, dataflow edges, FLOPs and live memory per layer."""

    def __init__(
        self,
        names: list[str],
        *,
        where: Callable[[], list[Any]] = list,
        progress: Callable[[str], None] | None = None,
    ):
        super().__init__()
        self.names = names
        self.where = where
        """Returns the modules whose forward is running (outermost first), for failures."""
        self.progress = progress
        self.records: dict[int, StorageRecord] = {}
        self.layers: dict[int, LayerRecord] = defaultdict(LayerRecord)
        self.phase = "idle"
        self.active: int | None = None
        self.last_finished: int | None = None
        self.num_started = 0
        self.first_layer: int | None = None
        self.node_owner: dict[Any, int] = {}
        self.bwd_owner: int = PENDING
        self._bwd_seen: set[int] = set()
        self._last_node: Any = None
        self._node_serial = 0
        """Count of the autograd nodes entered so far in the backward (each event's node)."""
        self.saved_owner: dict[int, int] = {}
        """Storage uid -> the owner that saved it first (its bytes are in that layer's record)."""
        self.savers: dict[int, set[int]] = defaultdict(set)
        """Storage uid -> every owner that saves it for backward (resolved at graph building)."""
        self.grad_storages: set[int] = set()
        """Storages some layer reads as an input through a view that requires grad: the sending
        stage of such a tensor gets gradient receive buffers for it (torch allocates them only
        for outputs that require grad)."""
        self._unread_inputs: dict[int, tuple[frozenset[int], int]] = {}
        """Inputs of the running layer call its ops have not read yet: uid -> (provenance,
        bytes)."""
        self.events: list[tuple[int, int, int, int]] = []
        """(window, autograd node serial, storage uid, +bytes on allocation / -bytes on
        release)."""
        self.windows: list[tuple[str, int]] = []
        """(phase, owner) of each maximal run of events with the same owner."""
        self._next_uid = 0
        self.failure: tuple[str, list[Any]] | None = None
        """(failing op, running modules) of the first op that raised."""
        self.transient_peaks: dict[int, int] = {}
        self.vocab_rows: dict[int, int] = {}
        """Vocabulary tag -> rows (``tensor_parallel.TensorParallelTracker`` tags each LM-head
        candidate's output)."""
        self.vocab_uids: dict[int, int] = {}
        """Storage uid -> vocabulary tag of every tagged storage."""
        self.in_experts: Callable[[], bool] = lambda: False
        """Whether the running op is inside a routed-experts module (set by
        ``experts.ExpertTracker``)."""

    # -- owners ---------------------------------------------------------------------------

    def owner(self) -> int:
        if self.phase == "bwd":
            return self.bwd_owner
        if self.active is not None:
            return self.active
        return self.last_finished if self.last_finished is not None else PENDING

    def resolve(self, owner: int) -> int:
        return self.first_layer if owner == PENDING and self.first_layer is not None else owner

    # -- storage records ------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, kind: str, name: str | None = None) -> None:
        """Record a tensor that exists before the run (parameter, buffer, model input)."""
        record = self.record_of(tensor, create=True, kind=kind)
        if record is not None and record.kind == "activation":
            record.kind, record.name = kind, name
        elif record is not None and record.name is None:
            record.name = name

    def record_of(
        self, tensor: torch.Tensor, *, create: bool = False, kind: str = "activation"
    ) -> StorageRecord | None:
        storage = storage_of(tensor)
        if storage is None:
            return None
        record = self.records.get(id(storage))
        if record is None and create:
            record = self._new_record(storage, kind=kind, tracked=False)
        return record

    def _new_record(self, storage: torch.UntypedStorage, *, kind: str, tracked: bool):
        key = id(storage)
        record = StorageRecord(
            uid=self._next_uid, nbytes=storage.nbytes(), kind=kind, tracked=tracked
        )
        self._next_uid += 1
        # The callback runs when the storage dies, before its id can be reused.
        record.ref = weakref.ref(storage, lambda _, key=key: self._release(key))
        self.records[key] = record
        if tracked:
            self._event(record.uid, record.nbytes)
        return record

    def _release(self, key: int) -> None:
        record = self.records.pop(key, None)
        if record is not None and record.tracked and self.phase in ("fwd", "bwd"):
            self._event(record.uid, -record.nbytes)

    def _event(self, uid: int, delta: int) -> None:
        context = (self.phase, self.owner())
        if not self.windows or self.windows[-1] != context:
            self.windows.append(context)
        self.events.append((len(self.windows) - 1, self._node_serial, uid, delta))

    # -- layer boundaries (called from module hooks) -----------------------------------------

    def layer_enter(self, index: int, args: tuple, kwargs: dict) -> None:
        inputs = tensors_in((args, kwargs))
        assign_nodes(inputs, self.owner(), self.node_owner)
        record = self.layers[index]
        # Edges: each distinct input storage counts once per call, with its largest view.
        reads: dict[int, tuple[frozenset[int], int]] = {}
        for tensor in inputs:
            storage = self.record_of(tensor)
            if storage is None or storage.kind != "activation" or not storage.provenance:
                continue
            if tensor.requires_grad:
                self.grad_storages.add(storage.uid)
            previous = reads.get(storage.uid, (storage.provenance, 0))[1]
            reads[storage.uid] = (storage.provenance, max(previous, tensor_bytes(tensor)))
        # an input becomes an edge when the layer's ops read it (_commit_reads): pipeline()
        # sends a stage only what its traced ops use, not every argument (position ids)
        self._unread_inputs = reads
        record.calls += 1
        if record.first_call is None:
            record.first_call = self.num_started
            self.num_started += 1
            if self.first_layer is None:
                self.first_layer = index
            if self.progress is not None:
                self.progress(f"forward {self.names[index]}")
        self.active = index

    def layer_exit(self, index: int, output: Any) -> list[torch.Tensor]:
        outputs = tensors_in(output)
        unique = {id(t): t for t in outputs}
        self.layers[index].output_bytes += sum(tensor_bytes(t) for t in unique.values())
        self.layers[index].outputs = {}
        for tensor in outputs:
            record = self.record_of(tensor)
            if record is not None and record.kind == "activation":
                record.provenance = frozenset({index})
                self.layers[index].outputs[record.uid] = storage_of(tensor).nbytes()
        assign_nodes(outputs, index, self.node_owner)
        self._unread_inputs = {}
        self.active = None
        self.last_finished = index
        return outputs

    # -- phases -----------------------------------------------------------------------------

    def start_forward(self) -> None:
        self.phase = "fwd"

    def start_backward(self, loss: torch.Tensor) -> None:
        assign_nodes([loss], self.owner(), self.node_owner)
        self.bwd_owner = self.resolve(self.owner())
        self.phase = "bwd"
        if self.progress is not None:
            self.progress("backward")

    def finish(self) -> None:
        self.phase = "done"

    # -- saved tensors ----------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: charge the storage to the owner, once."""
        if self.phase != "fwd":
            return tensor
        record = self.record_of(tensor, create=True)
        if record is None or record.kind in ("param", "buffer"):
            return tensor
        owner = self.owner()
        self.savers[record.uid].add(owner)
        if record.uid in self.saved_owner:
            return tensor
        self.saved_owner[record.uid] = owner
        layer = self.layers[owner]
        nbytes = storage_of(tensor).nbytes()
        layer.saved.append((nbytes, record.taint))
        if record.vocab is not None:
            layer.vocab_saved.append((nbytes, record.vocab))
        if self.in_experts():
            layer.expert_saved.append((nbytes, record.taint))
        if self.active is None:
            layer.glue_saved_bytes += nbytes
        return tensor

    # -- ops ----------------------------------------------------------------------------------

    def _enter_node(self, node: Any) -> None:
        if node is None or node is self._last_node:
            return
        self._last_node = node
        self._node_serial += 1
        owner = self.node_owner.get(node)
        if owner is None:
            return
        owner = self.resolve(owner)
        self.bwd_owner = owner
        if owner not in self._bwd_seen:
            self._bwd_seen.add(owner)
            if self.progress is not None and 0 <= owner < len(self.names):
                self.progress(f"backward {self.names[owner]}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase == "bwd":
            self._enter_node(current_autograd_node())
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.failure is None:
                self.failure = (str(func), self.where())
            raise
        if func in _IGNORED_OPS or self.phase not in ("fwd", "bwd"):
            return out
        if self._unread_inputs and self.active is not None:
            self._commit_reads(self.active, tensors_in((args, kwargs)))
        owner = self.owner()
        formula = FLOP_FORMULAS.get(func.overloadpacket)
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not cover this call (nested tensors, ...)
                flops = 0
            if self.phase == "fwd":
                self.layers[owner].fwd_flops += flops
            else:
                self.layers[owner].bwd_flops += flops
        outputs = tensors_in(out)
        if not outputs:
            return out
        tag = self._vocab_tag(args, kwargs) if self.vocab_rows else None
        if self.phase == "bwd":
            for tensor in outputs:
                storage = storage_of(tensor)
                if storage is not None and id(storage) not in self.records:
                    record = self._new_record(storage, kind="activation", tracked=True)
                    self.tag_vocab(record, tensor, tag)
            return out
        provenance: frozenset[int] = frozenset()
        taint: frozenset[int] = frozenset()
        glue = self.active is None
        for tensor in tensors_in((args, kwargs)):
            record = self.record_of(tensor)
            if record is None:
                continue
            if record.kind in ("param", "input") and record.first_user is None:
                record.first_user = owner
            if record.kind == "activation":
                provenance |= record.provenance
                taint |= record.taint
                if glue:
                    self._glue_reads(owner, record, tensor)
        if glue and (provenance or owner != PENDING):
            # glue runs on its owner's stage: what it makes there (from layers' data, or from the
            # model inputs and buffers alone: Llama's rotary cos/sin) is sent from there
            provenance = frozenset({owner})
        for tensor in outputs:
            storage = storage_of(tensor)
            if storage is None:
                continue
            record = self.records.get(id(storage))
            if record is None:
                record = self._new_record(storage, kind="activation", tracked=True)
                inside = self.active is not None
                record.provenance = frozenset({self.active}) if inside else provenance
                record.taint = taint
                self.tag_vocab(record, tensor, tag)
            elif record.kind == "activation":
                # A view or an in-place update by glue: the buffer now holds the owner's data
                if glue and provenance:
                    record.provenance = provenance
                record.taint |= taint
        return out

    def _vocab_tag(self, args, kwargs) -> int | None:
        """The vocabulary tag of an op's inputs (the first tagged one), or None."""
        for tensor in tensors_in((args, kwargs)):
            record = self.record_of(tensor)
            if record is not None and record.vocab is not None:
                return record.vocab
        return None

    def tag_vocab(self, record: StorageRecord, tensor: torch.Tensor, tag: int | None) -> None:
        """Tag a new storage made from a tagged input when its last dimension is that
        vocabulary (a logits-shaped tensor; the gradient of the head's input is [b, s, h])."""
        if tag is not None and tensor.dim() and tensor.shape[-1] == self.vocab_rows[tag]:
            record.vocab = tag
            self.vocab_uids[record.uid] = tag

    def _commit_reads(self, index: int, tensors: Iterable[torch.Tensor]) -> None:
        """Layer ``index``'s op reads these tensors: each input of the call among them gives its
        edges src -> index (once per call, with its largest view; ``layer_enter``)."""
        edges = self.layers[index].in_edges
        for tensor in tensors:
            record = self.record_of(tensor)
            if record is None:
                continue
            read = self._unread_inputs.pop(record.uid, None)
            if read is None:
                continue
            provenance, nbytes = read
            for src in provenance:
                if src != index:
                    edges[(src, record.uid)] += nbytes

    def _glue_reads(self, owner: int, record: StorageRecord, tensor: torch.Tensor) -> None:
        """Glue of ``owner`` reads another layer's output: an edge src -> owner carrying that
        storage (its largest view; once however often the glue reads it)."""
        edges = self.layers[owner].in_edges
        if tensor.requires_grad:
            self.grad_storages.add(record.uid)
        for src in record.provenance:
            if src != owner:
                key = (src, record.uid)
                edges[key] = max(edges.get(key, 0), tensor_bytes(tensor))

    # -- results ------------------------------------------------------------------------------

    def model_input_bytes_by_reader(self) -> dict[int, int]:
        """Layer -> bytes of the model's inputs (``register(..., "input")``) it is the first to
        read (glue before the first layer: the first layer): the data a pipeline's ``step()``
        is given for the stage holding that layer (``Layer.model_input_bytes``)."""
        read: dict[int, int] = defaultdict(int)
        for record in self.records.values():
            if record.kind == "input" and record.first_user is not None:
                read[self.resolve(record.first_user)] += record.nbytes
        return dict(read)

    def unsaved_output_bytes(self, index: int) -> int:
        """Bytes of layer ``index``'s output storages that no op saved for backward (batch
        total): what a pipeline schedule that runs the loss outside the model
        (``loss_fn(output, target)``) keeps beside the saved tensors while the micro-batch is
        in flight."""
        return sum(
            nbytes
            for uid, nbytes in self.layers[index].outputs.items()
            if uid not in self.saved_owner
        )

    def vocab_transients(
        self,
        excluded: set[int],
        vocab: set[int],
        at: set[int] | None = None,
        held: frozenset[int] | set[int] = frozenset(),
    ) -> dict[int, tuple[int, int]]:
        """Owner -> (largest fixed part, largest vocabulary part) of ``transients``' extra live
        bytes at any moment (batch totals; ``vocab``: the uids of vocabulary-sized storages).
        Each moment's extra bytes are its fixed plus its vocabulary part, so a vocabulary split
        over t ranks holds at most fixed + vocabulary / t at every moment."""
        peaks: dict[int, tuple[int, int]] = defaultdict(lambda: (0, 0))
        live = [0, 0]
        base, credit = [0, 0], [0, 0]
        current = -1
        making = _GradientMoments(at, held)
        for window, node, uid, delta in self.events:
            phase, owner = self.windows[window]
            owner = self.resolve(owner)
            part = int(uid in vocab)
            if window != current:
                current, base, credit = window, list(live), [0, 0]
                making.reset()
            counts = making.counts(node, uid, delta)
            if uid in excluded:
                saver = self.saved_owner.get(uid)
                if delta < 0 and phase == "bwd" and saver is not None:
                    if self.resolve(saver) == owner:
                        credit[part] -= delta
            else:
                live[part] += delta
            if counts:
                peaks[owner] = _larger(peaks[owner], live, base, credit)
        return dict(peaks)

    def transients(
        self,
        excluded: set[int],
        at: set[int] | None = None,
        only: str | None = None,
        held: frozenset[int] | set[int] = frozenset(),
    ) -> dict[int, int]:
        """Peak extra live bytes per owner while it runs (batch totals); ``only`` ("bwd"): in
        that phase's windows alone; with ``at``, only at
        the moments the storages in ``at`` are made and until the autograd node that made one
        returns (the parameter gradients: what else is live next to a weight gradient's
        temporary, which lives until the node's AccumulateGrad adds it to ``.grad``; torch's
        linear backward makes the input gradient after the weight gradient, in the same node),
        and while a storage in ``held`` made in the window is live (a partial gradient autograd
        keeps for a later sum: a tied LM head's gradient of the embedding table).

        For each window (a maximal run of events with one owner), the live bytes of storages
        made by the run, minus their value at the window's start, minus (in the backward) the
        owner's saved storages released so far in the window. ``excluded`` (saved storages,
        parameter gradients) never count: the cost model holds them elsewhere.
        """
        peaks: dict[int, int] = defaultdict(int)
        live = base = credit = 0
        current = -1
        making = _GradientMoments(at, held)
        for window, node, uid, delta in self.events:
            phase, owner = self.windows[window]
            owner = self.resolve(owner)
            if window != current:
                current, base, credit = window, live, 0
                making.reset()
            counts = making.counts(node, uid, delta)
            if uid in excluded:
                saver = self.saved_owner.get(uid)
                if (
                    delta < 0
                    and phase == "bwd"
                    and saver is not None
                    and self.resolve(saver) == owner
                ):
                    credit -= delta
            else:
                live += delta
            if counts and only in (None, phase):
                peaks[owner] = max(peaks[owner], live - base - credit)
        return dict(peaks)


class _GradientMoments:
    """Which events of ``Tracer.events`` are weight-gradient moments: with ``at`` None every
    event; else from the allocation of a storage in ``at`` (a parameter gradient) until the
    autograd node that made it returns (or the window ends). A weight gradient is a temporary
    until autograd's AccumulateGrad, which runs right after that node (its sequence number is
    the largest), adds it to ``.grad``: whatever the node makes after it (torch's linear
    backward: the input gradient) is live beside it. A node's allocation after its gradient
    counts once the gradient's own event is seen. A storage of ``held`` (a partial gradient
    autograd keeps until a later node sums it) makes every moment a weight-gradient one while
    it is live in the window that made it."""

    def __init__(self, at: set[int] | None, held: frozenset[int] | set[int] = frozenset()):
        self.at = at
        self.held = held
        self.node: int | None = None
        self.live_held: set[int] = set()

    def reset(self) -> None:
        self.node = None
        self.live_held = set()

    def counts(self, node: int, uid: int, delta: int) -> bool:
        if self.at is None:
            return True
        if uid in self.held:
            (self.live_held.add if delta > 0 else self.live_held.discard)(uid)
        if uid in self.at and delta > 0:
            self.node = node
        elif node != self.node:
            self.node = None
        return self.node is not None or bool(self.live_held)


def _larger(peak: tuple[int, int], live: list[int], base: list[int], credit: list[int]):
    """Each part's maximum so far with this moment's (live - base - credit)."""
    return tuple(max(peak[k], live[k] - base[k] - credit[k]) for k in (0, 1))
