"""Precision and optimizer as words: the one table of bytes per parameter.

A training run holds, per parameter, its weights (w), its gradients (g) and its optimizer state
(o). ``--precision`` and ``--optimizer`` name the run; :func:`bytes_per_param` gives (w, g, o)
for them on a pipeline runtime. ``--bytes-per-param W,G,O`` (``TrainingConfig``'s
``*_bytes_per_param`` fields) overrides the table and always wins.

The table, bytes per parameter (m = the optimizer's moments per parameter, :data:`MOMENTS`):

==============  =========  =====  ==============  =====================================
precision       runtime    w      g               o
==============  =========  =====  ==============  =====================================
fp32            any        4      4               4 m
bf16            any        2      2               2 m
bf16-mixed      megatron   2      4 (main_grad)   4 + 4 m (fp32 master + fp32 moments)
bf16-mixed      torch      2      2               4 + 4 m
fp16-mixed      megatron   2      2               4 + 4 m
fp16-mixed      torch      2      2               4 + 4 m
==============  =========  =====  ==============  =====================================

With Adam (m = 2): fp32 4 + 4 + 8 = 16 bytes; bf16-mixed on megatron 2 + 4 + 12 = 18, on torch
2 + 2 + 12 = 16; pure bf16 2 + 2 + 4 = 8.

Sources, word by word:

- **fp32**: weights, gradients and every optimizer state in fp32, no master copy. torch.optim's
  Adam/AdamW create ``exp_avg`` and ``exp_avg_sq`` with ``torch.zeros_like(param)`` (the
  parameter's dtype), SGD with momentum one ``momentum_buffer``, plain SGD none. Measured: the
  torch executor (``profiling.executors.torch_zoo``: its model is built in torch's default dtype,
  fp32, and trained with ``torch.optim.Adam``) and the megatron executor's fp32 runs hold 4 + 4 + 8
  (``tests/test_megatron.py``).
- **bf16** (pure bf16, no master copy): the same torch optimizers on bf16 parameters keep their
  states in bf16 (``zeros_like``); what ``scripts/cuda_memory_check.py`` measures (2, 2, 4 with
  Adam). Neither executor runs it (``profiling.run``: the torch executor trains fp32, the megatron
  executor runs 2 weight bytes as bf16-mixed).
- **bf16-mixed on megatron**: Megatron-LM's ``--bf16``. ``Float16Module`` casts the weights to
  bf16 (2); ``DistributedDataParallel`` accumulates gradients in an fp32 ``main_grad`` buffer
  (``accumulate_allreduce_grads_in_fp32``, which ``--bf16`` sets: 4); the optimizer
  (``Float16OptimizerWithFloat16Params``, or the distributed optimizer) keeps an fp32 master copy
  and fp32 moments (4 + 4 m). Megatron-LM's distributed-optimizer guide
  (``docs/api-guide/dist_optimizer.md``) gives 18 bytes (6 + 12/d sharded) for Adam; the megatron
  executor (``profiling.executors.megatron``: ``Float16Module``, ``grad_reduce_in_fp32``,
  ``get_megatron_optimizer(bf16=True)``) measures exactly 2 + 4 + 12.
- **bf16-mixed on torch**: the ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020,
  section 3.1: "2Ψ + 2Ψ + 12Ψ"): 16-bit weights and gradients, an fp32 master copy and fp32
  moments; DeepSpeed's bf16/fp16 optimizers hold this. The torch executor does not run it (it
  trains fp32). torch AMP (``torch.autocast``) keeps fp32 parameters, gradients and states:
  plan such a run as ``--precision fp32`` (autocast changes activations, which the graph's
  profile records, not the states).
- **fp16-mixed**: as bf16-mixed but Megatron-LM's ``--fp16`` does not set
  ``accumulate_allreduce_grads_in_fp32`` (only ``--bf16`` does), so its ``main_grad`` is fp16 (2);
  the loss scaler adds a few scalars. Neither executor runs fp16.

The default precision follows the graph (:func:`graph_precision`): the dtype it was profiled in,
``meta["dtype"]`` (``profiling.export --dtype``): fp32 -> fp32, bf16 -> bf16-mixed,
fp16 -> fp16-mixed; a graph without one -> bf16-mixed, the planner's historical default.

The optimizer step's temporary (:func:`step_temporary_bytes_per_param`), by implementation
(``--optimizer-impl``, :data:`OPTIMIZER_IMPLS`):

- **foreach** (torch.optim's default on a GPU: ``_default_to_fused_or_foreach`` picks it when every
  parameter is a plain or DTensor tensor on CUDA): Adam and AdamW's ``_multi_tensor_adam``
  (torch 2.13 ``torch/optim/adam.py``) make ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``
  for every parameter of a (device, dtype) group at once, then divide and add to it in place and
  free it after ``_foreach_addcdiv_``: one tensor the size of all the optimizer's parameters in
  the state's dtype, live beside weights, gradients and states. Adam with a weight decay (not
  torch's default 0) makes ``torch._foreach_add(grads, params)``, a gradient-sized copy freed
  (``del device_grads``) before the square root is made; AdamW decays in place; ``maximize``
  negates into a copy with the same lifetime. None of these is live with the square root, so
  the temporary is one state element per parameter: 4 bytes for fp32 states (fp32 and the mixed
  precisions' fp32 master states), 2 for pure bf16. SGD's ``_multi_tensor_sgd`` updates its
  momentum buffers in place (a copy only with ``nesterov`` or a weight decay): 0. Lion has no
  torch.optim implementation: 0.
- **fused** (``fused=True``, torchtitan's default; TransformerEngine/apex ``FusedAdam`` in
  Megatron-LM, ``multi_tensor_apply``): one kernel updates each parameter in place: 0.

No torch here: the planner imports this.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from solver.errors import InputError, quote

PRECISIONS = ("fp32", "bf16", "bf16-mixed", "fp16-mixed")
"""The words of ``--precision`` / ``TrainingConfig.precision``."""

MOMENTS = {"adam": 2, "adamw": 2, "lion": 1, "sgd-momentum": 1, "sgd": 0}
"""Optimizer state tensors per parameter, each the size of the parameter: Adam and AdamW keep
``exp_avg`` and ``exp_avg_sq`` (Kingma & Ba 2015; Loshchilov & Hutter 2019), Lion one momentum
(Chen et al. 2023), SGD with momentum one ``momentum_buffer``, plain SGD none (torch.optim)."""

OPTIMIZERS = tuple(MOMENTS)
"""The words of ``--optimizer`` / ``TrainingConfig.optimizer``."""

OPTIMIZER_IMPLS = ("foreach", "fused")
"""How the optimizer step runs (``--optimizer-impl`` / ``TrainingConfig.optimizer_impl``): torch's
multi-tensor ``foreach`` kernels (its default on a GPU; a step temporary) or a ``fused`` kernel
(in place: none)."""

DEFAULT_OPTIMIZER_IMPL = {"megatron": "fused", "torch": "foreach"}
"""``TrainingConfig.optimizer_impl`` when None: Megatron-LM steps with TransformerEngine's or
apex's FusedAdam; a torch run builds ``torch.optim.Adam(params)``, which is foreach on a GPU."""

STEP_TEMPORARY_STATES = {"adam": 1, "adamw": 1, "lion": 0, "sgd-momentum": 0, "sgd": 0}
"""State-sized temporaries live at once in a foreach step (module docstring): Adam and AdamW
one (the square root of ``exp_avg_sq``), the others none."""

DEFAULT_PRECISION = "bf16-mixed"
"""The precision of a graph that records no dtype (what the planner assumed before the words)."""

GRAPH_DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "fp16": "fp16-mixed",
    "float16": "fp16-mixed",
}
"""A graph's ``meta["dtype"]`` (``profiling.export`` writes fp32, bf16 or fp16) -> the default
precision of a plan for it."""

BYTE_FIELDS = ("weight_bytes_per_param", "grad_bytes_per_param", "optimizer_bytes_per_param")
"""TrainingConfig's bytes per parameter, in (w, g, o) order."""


def bytes_per_param(precision: str, optimizer: str, runtime: str) -> tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter of ``precision`` with ``optimizer`` on
    ``runtime`` (the module's table)."""
    check_words(precision, optimizer)
    moments = MOMENTS[optimizer]
    if precision == "fp32":
        return 4, 4, 4 * moments
    if precision == "bf16":
        return 2, 2, 2 * moments
    # mixed: 16-bit weights, an fp32 master copy and fp32 moments; gradients in fp32 only in
    # Megatron-LM's bf16 main_grad (accumulate_allreduce_grads_in_fp32)
    grads = 4 if (precision == "bf16-mixed" and runtime == "megatron") else 2
    return 2, grads, 4 + 4 * moments


def step_temporary_bytes_per_param(precision: str, optimizer: str, impl: str) -> int:
    """Bytes per parameter of the temporary that ``optimizer``'s step makes under ``impl`` beside
    the weights, gradients and states (module docstring): one state element per parameter for a
    foreach Adam or AdamW (4 with fp32 states, 2 with bf16 ones), else 0."""
    check_words(precision, optimizer)
    if impl not in OPTIMIZER_IMPLS:
        raise InputError(
            f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {quote(impl)}"
        )
    if impl != "foreach":
        return 0
    state_element = 2 if precision == "bf16" else 4  # mixed precisions keep fp32 states
    return STEP_TEMPORARY_STATES[optimizer] * state_element


def check_words(precision: str, optimizer: str) -> None:
    """InputError naming the valid words when either is unknown."""
    if precision not in PRECISIONS:
        raise InputError(
            f"precision must be one of {', '.join(PRECISIONS)}, got {quote(precision)}"
        )
    if optimizer not in OPTIMIZERS:
        raise InputError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {quote(optimizer)}"
        )


def graph_precision(graph: Any) -> str:
    """The default precision of a plan for ``graph``: its ``meta["dtype"]`` mapped by
    :data:`GRAPH_DTYPES`, :data:`DEFAULT_PRECISION` when it records none; InputError for a dtype
    with no word (say --precision)."""
    dtype = (getattr(graph, "meta", None) or {}).get("dtype")
    if dtype is None:
        return DEFAULT_PRECISION
    if not isinstance(dtype, str) or dtype.lower() not in GRAPH_DTYPES:
        raise InputError(
            f"graph {getattr(graph, 'model', '')!s}: meta.dtype {quote(dtype)} has no default "
            f"precision (known: fp32, bf16, fp16); give --precision "
            f"{'|'.join(PRECISIONS)}"
        )
    return GRAPH_DTYPES[dtype.lower()]


def for_graph(training: Any, graph: Any) -> Any:
    """``training`` with its precision resolved for ``graph``: when ``training.precision`` is
    None, the graph's (:func:`graph_precision`) and the table's bytes for the byte fields that
    were not given; else ``training`` itself."""
    if training.precision is not None:
        return training
    filled = {name: None for name in training.bytes_from_table}
    return dataclasses.replace(training, precision=graph_precision(graph), **filled)


def describe(training: Any) -> str:
    """One line for reports: 'precision bf16-mixed, adam: 2+4+12 bytes/param', and the table's
    bytes when --bytes-per-param gave others."""
    w, g, o = (getattr(training, name) for name in BYTE_FIELDS)
    precision = training.precision or DEFAULT_PRECISION
    text = f"precision {precision}, {training.optimizer}: {w}+{g}+{o} bytes/param"
    table = bytes_per_param(precision, training.optimizer, training.runtime)
    if (w, g, o) != table:
        text += (
            f" (--bytes-per-param; the table gives {'+'.join(map(str, table))} for "
            f"{precision} {training.optimizer} on {training.runtime})"
        )
    return text
