"""Megatron-style tensor-parallel split of a profiled layer: ``tp_params``,
``tp_activation_bytes`` and ``tp_comm_bytes``.

The rule (Shoeybi et al. 2019, "Megatron-LM", section 3; Korthikanti et al. 2022, section 4),
applied to the ``nn.Linear`` and ``nn.Embedding`` modules the forward actually calls:

- **Column-parallel Linear**: one whose input is replicated (not derived from a column-parallel
  output) and whose output, and everything computed from it, reaches a row-parallel Linear before
  it leaves the layer. Its weight and bias are split; its output is sharded.
- **Row-parallel Linear**: one whose input derives from column-parallel outputs. Its weight is
  split; its bias is replicated; its output is all-reduced (replicated again).

  On transformer blocks this is the widen/narrow rule (qkv, fc1, gate and up widen and are
  column-parallel; proj, fc2 and down narrow and are row-parallel, paired in order); the dataflow
  form also covers separate square q/k/v/o projections. A Linear whose sharded output would leave
  the layer (a lone projection, a classifier) stays replicated.
- **Vocabulary-parallel embedding**: an ``nn.Embedding`` with at least
  :data:`VOCAB_PARALLEL_MIN_ROWS` rows (a vocabulary; position tables and small vocabularies stay
  replicated). Its table is split by rows; its output is all-reduced in the forward.
- **Vocabulary-parallel LM head**: a Linear with replicated input whose ``out_features`` equals
  the row count of a vocabulary-parallel embedding. Its weight (and bias) is split and its logits
  stay sharded through the loss (Megatron's vocab-parallel cross-entropy), so it needs no
  row-parallel partner.

Sharded region. A *taint* (the set of column-parallel candidate calls a tensor derives from)
flows through every op (``dataflow.Tracer``): the outputs of an op carry the union of its inputs'
taints, a column-parallel Linear sets its output's taint to itself, and a row-parallel Linear
clears it. A saved tensor is split (``tp_activation_bytes``) when its taint is non-empty and every
candidate in it turned out column-parallel: the attention's Q, K, V, scores, softmax, its dropout
mask and output, the projection input, the GeLU input and the fc2 input (Korthikanti's
24sh + 5as^2). Inputs of column-parallel Linears and LayerNorms, residual dropout masks and
anything built only from replicated data (the causal mask) are replicated.

Communication (``tp_comm_bytes``, per sample, forward + backward):

- the forward all-reduce of each row-parallel output;
- the backward all-reduce of the input gradient of column-parallel Linears, once per distinct
  input tensor (q, k and v reading one LayerNorm output need one), when that input needs a
  gradient;
- the forward all-reduce of a vocabulary-parallel embedding's output;
- for an LM head, the backward all-reduce of its input gradient plus three fp32 per-token
  all-reduces of the vocab-parallel cross-entropy (max, sum of exponentials, target logit): 12
  bytes per token.

Routed experts (a module path with an ``experts`` component, ``experts.py``) are left out: their
Linear calls are neither column- nor row-parallel, and their parameters go to ``expert_params``.

Sequence parallelism (``sp_gathered_bytes``, per sample): the bytes of the distinct inputs of the
column-parallel candidates, whole sequence (``gathered_bytes``), plus the saved tensors derived
from a candidate left replicated (``graph_builder``). Under SP each input is all-gathered from the
[s/t] shards in front of its Linear; Megatron saves the shard, eager torch
(``profiling.executors.parallelize``) the gathered tensor.

Vocabularies per runtime (``solver.costs.vocab``; ``vocab_rows``, ``vocab_params``,
``vocab_activation_bytes`` and the transients' parts): Megatron splits every vocabulary, so
the profile also names the vocabulary tables below 16384 rows. A vocabulary is the row count of
an ``nn.Embedding`` fed a model input (token ids; position tables read built indices) or of one
with 16384+ rows; its tables are those embeddings and each LM head: a Linear with replicated
input, that many outputs and another input width, not column-parallel. The head's output is
tagged (``Tracer.vocab_rows``) and so is every tensor made from a tagged one whose last
dimension is the vocabulary: the saved bytes and the transients' parts that scale with it.

Only module calls are seen: a functional ``F.linear`` (for example an LM head that reuses the
embedding matrix without an ``nn.Linear``) is treated as replicated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from profiling.trace.dataflow import StorageRecord, Tracer, tensor_bytes, tensors_in
from profiling.trace.experts import is_expert_path
from solver.graph_fields import VOCAB_PARALLEL_MIN_ROWS

CROSS_ENTROPY_BYTES_PER_TOKEN = 12
"""Vocab-parallel cross-entropy: three fp32 all-reduces per token (max, sum-exp, target logit)."""


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's Linear with a transposed [in, out] weight)."""
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    )


def out_features(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.nf


def _in_features(module: nn.Module) -> int:
    return module.in_features if isinstance(module, nn.Linear) else module.weight.shape[0]


@dataclass(kw_only=True)
class _LinearCall:
    module: nn.Linear
    layer: int
    role: str
    """``column`` or ``head`` (candidates) or ``row``."""
    input_taint: frozenset[int] = frozenset()
    input_uid: int | None = None
    input_bytes: int = 0
    input_needs_grad: bool = False
    output_bytes: int = 0
    tokens: int = 0


@dataclass(kw_only=True)
class TensorParallelSplit:
    """The resolved split."""

    valid: frozenset[int]
    """Candidate calls that are column-parallel (or LM heads)."""
    split_params: set[int] = field(default_factory=set)
    """``id()`` of the parameters split across TP ranks."""
    comm_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Layer -> all-reduced bytes, batch total."""
    roles: dict[str, str] = field(default_factory=dict)
    """Module path -> ``column`` | ``row`` | ``vocab`` (for meta)."""
    heads: set[int] = field(default_factory=set)
    """``id()`` of the vocabulary-parallel LM-head modules."""
    vocab_tags: set[int] = field(default_factory=set)
    """The LM-head calls whose tagged tensors are vocabulary-sized (``Tracer.vocab_rows``)."""
    vocab_params: dict[int, int] = field(default_factory=dict)
    """``id()`` of each vocabulary table's parameters -> the vocabulary's rows."""
    vocab_layers: dict[int, int] = field(default_factory=dict)
    """Layer -> the rows of the vocabulary its tables or LM head have (``vocab_rows``)."""
    gathered_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Layer -> bytes of the distinct inputs of its column-parallel candidates (every Linear
    reading replicated data: column-parallel, LM head, or one left replicated), batch total:
    what sequence parallelism all-gathers in front of them (``sp_gathered_bytes``)."""

    def is_split(self, taint: frozenset[int]) -> bool:
        return bool(taint) and taint <= self.valid


class TensorParallelTracker:
    """Classifies Linear and Embedding calls during the traced run (called from module hooks)."""

    def __init__(self, root: nn.Module, tracer: Tracer):
        self.tracer = tracer
        self.paths = {module: path for path, module in root.named_modules()}
        self.vocab_sizes = {
            m.num_embeddings
            for m in root.modules()
            if isinstance(m, nn.Embedding) and m.num_embeddings >= VOCAB_PARALLEL_MIN_ROWS
        }
        self.calls: list[_LinearCall] = []
        self._open: dict[int, list[int]] = defaultdict(list)
        self.escaped: set[int] = set()
        self.embeddings: list[tuple[nn.Embedding, int, int]] = []
        self.token_tables: dict[int, tuple[nn.Embedding, int]] = {}
        """id -> (embedding fed a model input, layer): vocabulary tables of any size."""

    def linear_enter(self, module: nn.Linear, args: tuple, kwargs: dict) -> None:
        layer = self.tracer.active
        inputs = tensors_in((args, kwargs))
        if layer is None or not inputs or is_expert_path(self.paths.get(module, "")):
            return
        x = inputs[0]
        record = self.tracer.record_of(x)
        taint = record.taint if record is not None else frozenset()
        if taint:
            call = _LinearCall(module=module, layer=layer, role="row", input_taint=taint)
        else:
            role = "head" if out_features(module) in self.vocab_sizes else "column"
            call = _LinearCall(
                module=module,
                layer=layer,
                role=role,
                input_uid=record.uid if record is not None else None,
                input_bytes=tensor_bytes(x),
                input_needs_grad=x.requires_grad,
            )
        self._open[id(module)].append(len(self.calls))
        self.calls.append(call)

    def linear_exit(self, module: nn.Linear, output: object) -> None:
        stack = self._open.get(id(module))
        if not stack:
            return
        index = stack.pop()
        call = self.calls[index]
        outputs = tensors_in(output)
        if not outputs:
            return
        y = outputs[0]
        call.output_bytes = tensor_bytes(y)
        call.tokens = y.numel() // max(out_features(module), 1)
        record: StorageRecord | None = self.tracer.record_of(y)
        if record is not None and record.kind == "activation":
            record.taint = frozenset() if call.role == "row" else frozenset({index})
            rows = out_features(module)
            if call.role != "row" and rows in self.vocabularies() and _in_features(module) != rows:
                # a possible LM head: its logits are tagged (resolve keeps it unless it turns
                # out column-parallel)
                self.tracer.vocab_rows[index] = rows
                self.tracer.tag_vocab(record, y, index)

    def vocabularies(self) -> set[int]:
        """Row counts of the vocabularies seen so far (module docstring)."""
        return self.vocab_sizes | {m.num_embeddings for m, _ in self.token_tables.values()}

    def embedding_exit(self, module: nn.Embedding, args: tuple, output: object) -> None:
        layer = self.tracer.active
        if layer is None:
            return
        ids = tensors_in(args)
        record = self.tracer.record_of(ids[0]) if ids else None
        if record is not None and record.kind == "input":
            self.token_tables.setdefault(id(module), (module, layer))
        if module.num_embeddings < VOCAB_PARALLEL_MIN_ROWS:
            return
        self.embeddings.append((module, layer, sum(tensor_bytes(t) for t in tensors_in(output))))

    def layer_outputs(self, outputs: list[torch.Tensor]) -> None:
        """A sharded tensor leaving its layer disqualifies the candidates it derives from."""
        for tensor in outputs:
            record = self.tracer.record_of(tensor)
            if record is not None:
                self.escaped |= record.taint

    def resolve(self) -> TensorParallelSplit:
        candidates = {i: c for i, c in enumerate(self.calls) if c.role in ("column", "head")}
        rows = [c for c in self.calls if c.role == "row"]
        heads = {i for i, c in candidates.items() if c.role == "head"}
        valid = heads | {
            i
            for i in candidates
            if i not in self.escaped and any(i in row.input_taint for row in rows)
        }
        while True:  # greatest fixpoint: a row needs all its candidates, a column a valid row
            valid_rows = [row for row in rows if row.input_taint <= valid]
            closed = frozenset().union(*(row.input_taint for row in valid_rows))
            narrowed = heads | (valid & closed)
            if narrowed == valid:
                break
            valid = narrowed
        split = TensorParallelSplit(valid=frozenset(valid))
        gathered: set[tuple[int, int]] = set()
        for i, call in candidates.items():
            # one all-gather per distinct input: q, k and v reading one norm output share it
            key = (call.layer, call.input_uid if call.input_uid is not None else -1 - i)
            if key not in gathered:
                gathered.add(key)
                split.gathered_bytes[call.layer] += call.input_bytes
        needs_all_reduce: set[tuple[int, int | None]] = set()
        for i in sorted(valid):
            call = candidates[i]
            split.split_params |= {id(p) for p in call.module.parameters(recurse=False)}
            split.roles[self.paths[call.module]] = "vocab" if call.role == "head" else "column"
            if call.role == "head":
                split.heads.add(id(call.module))
            key = (call.layer, call.input_uid if call.input_uid is not None else -1 - i)
            if call.input_needs_grad and key not in needs_all_reduce:
                needs_all_reduce.add(key)
                split.comm_bytes[call.layer] += call.input_bytes
            if call.role == "head":
                split.comm_bytes[call.layer] += CROSS_ENTROPY_BYTES_PER_TOKEN * call.tokens
        for row in valid_rows:
            split.split_params.add(id(row.module.weight))
            split.roles[self.paths[row.module]] = "row"
            split.comm_bytes[row.layer] += row.output_bytes
        for module, layer, nbytes in self.embeddings:
            split.split_params.add(id(module.weight))
            split.roles[self.paths[module]] = "vocab"
            split.comm_bytes[layer] += nbytes
        self._resolve_vocabularies(split)
        return split

    def _resolve_vocabularies(self, split: TensorParallelSplit) -> None:
        """The vocabulary tables and tags (module docstring): every tagged head that is not a
        column-parallel Linear, the embeddings of its row count."""
        for tag, rows in self.tracer.vocab_rows.items():
            call = self.calls[tag]
            if call.role == "column" and tag in split.valid:
                continue
            split.vocab_tags.add(tag)
            split.vocab_layers[call.layer] = rows
            for param in call.module.parameters(recurse=False):
                split.vocab_params[id(param)] = rows
        vocabularies = set(split.vocab_layers.values()) | self.vocab_sizes
        tables = [(m, layer) for m, layer in self.token_tables.values()]
        tables += [(m, layer) for m, layer, _ in self.embeddings]
        for module, layer in tables:
            if module.num_embeddings in vocabularies:
                split.vocab_params[id(module.weight)] = module.num_embeddings
                split.vocab_layers.setdefault(layer, module.num_embeddings)
