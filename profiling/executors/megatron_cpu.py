"""Megatron-core on CPU over gloo: every CUDA, TransformerEngine or apex assumption it makes,
bypassed in one place (8, in the layer spec, is
:class:`profiling.executors.megatron_model.TorchNorm`; 9, 10 and 12 are the MoE layer's; 11 the
tied output layer's).

megatron-core (``pip install -e ".[megatron]"``) trains a ``GPTModel`` built from its local
layer spec (no TransformerEngine, no apex) on CPU once these are bypassed, and nothing else
(0.16.1; ../shared/reference/runtime-memory-facts.md):

1. ``torch.cuda.current_device()`` is the device of the p2p receive buffers, the gradient
   buffers and the distributed optimizer's shards: it returns ``"cpu"`` here.
2. ``torch.cuda.synchronize()`` after the p2p exchange: a no-op.
3. Small tensors created with an explicit ``device="cuda"`` (the schedules' token count, the
   optimizer's ``found_inf``): :class:`CudaFactoriesOnCpu` rewrites a CUDA ``device=`` to the CPU
   in every torch call made while it is active.
4. The CUDA RNG: the tensor-parallel RNG tracker is Megatron's own inference tracker, whose
   ``fork()`` leaves the RNG alone (runs compared with predictions use dropout 0, so no random
   numbers are drawn inside the forward), and the RNG state that activation recomputation saves
   and restores is the CPU generator's.
5. The optimizers and the gradient clipping accept tensors only of the types
   ``torch.cuda.{Float,Half,BFloat16}Tensor``: ``Tensor.type()`` names a CPU tensor's type as its
   CUDA twin (``_cuda_type_name``).
6. Without TransformerEngine or apex, Megatron's optimizer falls back to ``torch.optim.AdamW``,
   whose default (per-tensor) step allocates two parameter-sized temporaries for the largest
   parameter; on a GPU Megatron runs a fused Adam that updates in place. :class:`FusedAdamW`
   (torch's own fused CPU kernel, ``fused=True``) restores that behaviour.
7. The fused bias-activation functions (Megatron-LM's default bias-GeLU / bias-SwiGLU fusion) and
   megatron-core's other ``jit_fuser`` functions are wrapped in ``torch.compile`` when imported;
   compiled on the CPU they keep buffers of their own next to the live tensors. They run as the
   plain torch functions they wrap (same saved tensors; :func:`_uncompiled`).
8. Without TransformerEngine or apex, the local layer spec's norm (``WrappedTorchNorm``)
   asserts that sequence parallelism is off. :class:`profiling.executors.megatron_model.TorchNorm`
   builds the same torch LayerNorm/RMSNorm without that assertion and marks its parameters
   ``sequence_parallel`` (what finalize_model_grads all-reduces over tp), as TransformerEngine's
   and apex's norms are marked; the model uses it for every norm, with or without SP.

9. The MoE all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``) creates a CUDA side
   stream when its first instance is built; dropless routing copies the token counts to the host
   on it (``torch.cuda.stream``, ``current_stream``, ``record_event``, ``synchronize``) so that
   the all-to-all's splits are known. On the CPU the counts are host tensors already: the stream
   is :data:`HOST_STREAM`, whose waits and events do nothing, ``torch.cuda.current_stream`` is
   that stream too and ``torch.cuda.stream`` a null context. The copy itself
   (``maybe_move_tensor_to_cpu``) leaves a tensor already on the host as it is, where the
   all-to-all needs its splits as numbers: :func:`_host_counts` converts them as the copy of a
   CUDA tensor would (``as_numpy``). (With ``--moe-pad-expert-input-to-capacity`` every count
   is known in advance and none of this runs.)
10. Without TransformerEngine, ``moe_utils`` never defines ``te_general_gemm`` (its import sits
    in the ``try`` that fails), yet the router's gating linear (``RouterGatingLinearFunction``)
    tests ``te_general_gemm is not None`` and raises NameError; the name is set to None, which
    is the fallback the function means: ``torch.mm`` in the router's dtype.
11. With tied embeddings and pp > 1 (``share_embeddings_and_output_weights``) the last stage's
    copy of the word embeddings is moved to the GPU before its first all-reduce with the first
    stage (``LanguageModule.setup_embeddings_and_output_layer``: ``weight.data.cuda()``):
    :class:`CudaFactoriesOnCpu` returns the CPU tensor itself for ``Tensor.cuda()``.
12. gloo's worker thread drops its references to a collective's tensors some time after the
    caller's wait has returned (``ProcessGroupGloo``'s run loop resets the finished work after
    completing its future), so the MoE all-to-all's input (the permuted tokens, the experts'
    sorted output) is freed at a moment that depends on thread timing, not on the program:
    measured at the peak of the padded ep 2 rows, one stage-0 rank held the combine's input
    (256 KiB) beside the unpermuted output in one run and not in the next, its peak +128 KiB
    (the same plan, padded to capacity). A GPU run frees it when the caller drops it.
    ``all_to_all_single`` (synchronous) exchanges private copies that no tracked storage
    shares (:func:`_all_to_all_on_copies`: made with the dispatch modes off, the result copied
    into the caller's output in place), so the tracked tensors live exactly as long as the
    program holds them.

Everything here runs only inside a rank process of ``profiling.run`` (``engine="megatron"``);
the patches are undone when the context exits.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from profiling._torch_compat import disable_current_modes

NO_FUSED_KERNELS = (
    r".*((Transformer Engine|Apex|TransformerEngine).*not installed|full scope is deprecated)"
)
"""megatron-core's warnings that it falls back to torch's own kernels, and one about its own default
CUDA-graph scope: expected here, and not the user's to act on."""


def quiet_fallback_warnings() -> None:
    """Silence the warnings that TransformerEngine and apex are missing (the local spec and
    torch's Adam are what runs here by design)."""
    warnings.filterwarnings("ignore", message=NO_FUSED_KERNELS)


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an index means a CUDA device (torch.cuda.current_device())
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Every torch call with a CUDA ``device=`` keyword gets ``device="cpu"`` instead, and
    ``Tensor.cuda()`` is the tensor itself (bypass 11)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class FusedAdamW(torch.optim.AdamW):
    """Bypass 6: ``torch.optim.AdamW`` with its fused kernel (in place, as TE/apex FusedAdam)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs, fused=True)


class _HostEvent:
    """Bypass 9: a recorded event on :data:`HOST_STREAM`, complete at once."""

    def synchronize(self) -> None:
        pass


class _HostStream:
    """Bypass 9: the MoE dispatcher's device-to-host stream on a CPU, where every tensor is
    on the host already and runs in order."""

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self, *_args) -> _HostEvent:
        return _HostEvent()


HOST_STREAM = _HostStream()


def _host_counts(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Bypass 9: ``maybe_move_tensor_to_cpu`` for host tensors: as numbers when asked."""
    del record_stream  # (no stream to record on)
    if isinstance(tensor, torch.Tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cuda_type_name(tensor: torch.Tensor, *args, _original=torch.Tensor.type, **kwargs):
    """Bypass 5: ``Tensor.type()`` of a CPU tensor reads ``torch.cuda.<Type>``."""
    name = _original(tensor, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or ".cuda." in name:
        return name
    return name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Bypasses 1-7, 9 and 10 for the whole run (building the model, the schedules, the
    optimizer step); 8 is in the layer spec."""
    import megatron.core.fusions.fused_bias_gelu  # noqa: F401  (the fusions the layers call)
    import megatron.core.fusions.fused_bias_swiglu  # noqa: F401
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *_, **__: None))
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        stack.enter_context(
            mock.patch.object(
                megatron_random, "_get_cuda_rng_state", lambda *_, **__: torch.get_rng_state()
            )
        )
        stack.enter_context(
            mock.patch.object(
                megatron_random,
                "_set_cuda_rng_state",
                lambda state, *_, **__: torch.set_rng_state(state),
            )
        )
        stack.enter_context(mock.patch.object(torch.Tensor, "type", _cuda_type_name))
        stack.enter_context(mock.patch.object(torch.optim, "AdamW", FusedAdamW))
        stack.enter_context(
            mock.patch.object(
                token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", HOST_STREAM
            )
        )
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *_: HOST_STREAM))
        stack.enter_context(
            mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _host_counts)
        )
        stack.enter_context(
            mock.patch.object(torch.cuda, "stream", lambda *_: contextlib.nullcontext())
        )
        if not hasattr(moe_utils, "te_general_gemm"):
            stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        for module, name, function in _uncompiled():
            stack.enter_context(mock.patch.object(module, name, function))
        stack.enter_context(CudaFactoriesOnCpu())
        stack.enter_context(
            mock.patch.object(
                torch.distributed,
                "all_to_all_single",
                functools.partial(_all_to_all_on_copies, torch.distributed.all_to_all_single),
            )
        )
        yield


def _all_to_all_on_copies(exchange, output, input, *args, async_op: bool = False, **kwargs):
    """``exchange`` (``torch.distributed.all_to_all_single``) on copies of ``input`` and
    ``output`` made outside every dispatch mode (no tracker counts them), the result copied
    into ``output`` in place: gloo's late release of the tensors it holds (bypass 12) then
    touches only those copies. An asynchronous call is passed through as it is."""
    if async_op:
        return exchange(output, input, *args, async_op=True, **kwargs)
    with disable_current_modes():
        private_input = input.clone()
        private_output = torch.empty_like(output)
    exchange(private_output, private_input, *args, **kwargs)
    del private_input
    output.copy_(private_output)
    return None


def _uncompiled() -> list[tuple[object, str, object]]:
    """(module, name, plain function) for every ``torch.compile``-wrapped function of the
    imported megatron-core modules (bypass 7)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("megatron.core") or module is None:
            continue
        for name, value in list(vars(module).items()):
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if callable(original):
                found.append((module, name, original))
    return found
