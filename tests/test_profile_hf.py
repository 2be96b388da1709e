"""HuggingFace models profiled as trained: per-layer saved bytes equal an independent measurement.

Tiny GPT-2, Llama (grouped-query heads, RMSNorm, rotary) and T5 (relative position bias,
encoder-decoder) from transformers, in fp32 and bf16, with transformers' default attention
(SDPA) and ``use_cache=False`` (a training step keeps no KV cache). The profile is the fake-tensor
one (``--device meta``); the measurement runs the same model on real CPU tensors, once, and sums
per layer the distinct storages that autograd saves (``saved_tensors_hooks``) while the layer's
forward runs (glue code outside every layer goes to the layer that ran last, as in
``profiling/trace/profile.py``). Both run attention as a GPU's fused kernels do
(``profiling/trace/cuda_attention.py``). Closed forms per block name every saved storage.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from profiling.hf.attention import FUSED  # noqa: E402
from profiling.hf.models import hf_spec  # noqa: E402
from profiling.trace.cuda_attention import CudaLikeAttention, cuda_like_kernels  # noqa: E402
from profiling.trace.layers import default_layer_paths  # noqa: E402
from profiling.trace.profile import profile_module  # noqa: E402

BATCH, SEQ = 2, 32
GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
LLAMA = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
T5 = dict(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, d_ff=128, num_heads=4)
MODELS = {"gpt2": GPT2, "llama-2-7b": LLAMA, "t5-base": {**T5, "vocab_size": 128}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLASH_RNG = {"fp32": 0, "bf16": 24 // BATCH}
"""Per sample: the flash kernel's rng_state and unused tensors (``cuda_attention.py``), 24 bytes
per attention call, in bf16 (fp32 attention runs the memory-efficient kernel)."""


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def measure_saved_bytes(model, inputs, layers: list[str]) -> tuple[dict, dict]:
    """(saved bytes, output bytes) per layer per sample of one real forward + backward."""
    named = dict(model.named_modules())
    path_of = {id(named[path]): path for path in layers}
    running: list[str] = []
    last = [layers[0]]
    saved: dict[int, tuple[str, int]] = {}
    outputs: dict[str, int] = defaultdict(int)
    kept = []  # keeps saved storages alive, so that their ids stay unique
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pre(module, args, kwargs):
        if id(module) in path_of:
            running.append(path_of[id(module)])

    def post(module, args, kwargs, output):
        if id(module) in path_of:
            last[0] = running.pop()
            leaves = {id(t): t for t in _tensors(output)}
            outputs[last[0]] += sum(t.numel() * t.element_size() for t in leaves.values())

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights and id(storage) not in saved:
            saved[id(storage)] = (running[-1] if running else last[0], storage.nbytes())
            kept.append(storage)
        return tensor

    handles = [h for m in model.modules() for h in _hooks(m, pre, post)]
    try:
        with cuda_like_kernels(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*inputs)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    per_layer = dict.fromkeys(layers, 0)
    for owner, nbytes in saved.values():
        per_layer[owner] += nbytes
    per_sample = lambda total: -(-total // BATCH)  # noqa: E731
    return (
        {k: per_sample(v) for k, v in per_layer.items()},
        {k: per_sample(outputs[k]) for k in layers},
    )


def _hooks(module, pre, post):
    return (
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    )


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def profiled_and_measured(name: str, dtype):
    spec = hf_spec(name, {**MODELS[name], "use_cache": False})
    with default_dtype(dtype):
        torch.manual_seed(0)
        model = spec.build()
        inputs = spec.example_inputs(BATCH, SEQ)
        with torch.device("meta"):
            shapes_only = spec.build()
        layers = default_layer_paths(model)
        graph = profile_module(shapes_only, inputs, layers, mode="fake")
        saved, outputs = measure_saved_bytes(model, inputs, layers)
    return graph, saved, outputs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_fake_profile_equals_the_measured_saved_bytes_of_every_layer(name, dtype):
    graph, saved, outputs = profiled_and_measured(name, DTYPES[dtype])
    assert {layer.name: layer.activation_bytes for layer in graph.layers} == saved
    assert {layer.name: layer.output_bytes for layer in graph.layers} == outputs


@pytest.mark.slow
def test_fake_profile_equals_the_real_profile_of_a_grouped_query_model():
    """Under fake tensors transformers would materialise the causal mask the real run skips (and
    repeat K and V for the masked SDPA call); the profiler gives it the real run's answer."""
    spec = hf_spec("llama-2-7b", {**LLAMA, "use_cache": False})
    with default_dtype(torch.bfloat16):
        torch.manual_seed(0)
        model = spec.build()
        inputs = spec.example_inputs(BATCH, SEQ)
        fake = profile_module(model, inputs, mode="fake")
        real = profile_module(model, inputs, mode="real")
    for a, b in zip(fake.layers, real.layers, strict=True):
        assert (a.name, a.activation_bytes, a.output_bytes) == (
            b.name,
            b.activation_bytes,
            b.output_bytes,
        )
        assert a.transient_bytes == b.transient_bytes


def _block(graph, name):
    return next(layer for layer in graph.layers if layer.name == name).activation_bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_block_saves_the_closed_form(dtype):
    """Per sample, s tokens, h hidden, a heads, e = bytes per element (fused attention):
    block input e sh, LayerNorm 1 output e sh and statistics (CPU keeps them in the input dtype:
    2 e s), the fused qkv 3 e sh (q, k, v are views of it), log-sum-exp 4 as (fp32), attention
    output e sh, 1-byte dropout mask sh, residual e sh, LayerNorm 2 e sh + 2 e s, the MLP's
    4h-wide fc output, tanh-GELU's three intermediates and its output 5 * 4 e sh, the second
    dropout mask sh. No s x s tensor: attention dropout regenerates its mask in the kernel. In
    bf16 the flash kernel's rng_state and unused tensors, 24 bytes per call (fp32 runs the
    memory-efficient kernel: not modelled)."""
    e = {"fp32": 4, "bf16": 2}[dtype]
    s, h, a = SEQ, GPT2["n_embd"], GPT2["n_head"]
    graph, _, _ = profiled_and_measured("gpt2", DTYPES[dtype])
    closed_form = (8 * e + 20 * e + 2) * s * h + 4 * a * s + 4 * e * s + FLASH_RNG[dtype]
    assert _block(graph, "transformer.h.1") == closed_form  # fp32 234,496; bf16 119,552


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_block_saves_the_closed_form(dtype):
    """Per sample (kv = kv_heads * head_dim, f = intermediate size): each RMSNorm keeps its input
    in fp32 (4 sh: a copy in bf16, the input itself in fp32), rsqrt 4 s, the normalised input in the
    input dtype e sh (for the weight's gradient) and its output e sh; rotated q e sh, rotated k and
    v e s kv each (grouped heads go to SDPA as they are: ``enable_gqa``, no repeat_kv copy);
    log-sum-exp 4 as, attention output e sh; SwiGLU gate, up, silu and product 4 e sf; in bf16
    the flash kernel's 24 bytes of RNG state per call."""
    e = {"fp32": 4, "bf16": 2}[dtype]
    s, h, a, f = SEQ, LLAMA["hidden_size"], LLAMA["num_attention_heads"], LLAMA["intermediate_size"]
    kv = LLAMA["num_key_value_heads"] * h // a
    graph, _, _ = profiled_and_measured("llama-2-7b", DTYPES[dtype])
    norm = 4 * s * h + 4 * s + 2 * e * s * h
    closed_form = 2 * norm + 2 * e * s * h + 2 * e * s * kv + 4 * a * s + 4 * e * s * f
    closed_form += FLASH_RNG[dtype]
    assert _block(graph, "model.layers.1") == closed_form


@pytest.mark.slow
def test_no_block_keeps_an_attention_matrix():
    """T5 with its learned relative position bias: what a block saves grows linearly in s except
    for the bias itself (1 x heads x s x s, shared by the batch: under a byte per sample at this
    batch); the math fallback's fp32 scores, softmax and dropout noise are gone."""
    per_block = {}
    for seq in (32, 64):
        spec = hf_spec("t5-base", {**MODELS["t5-base"], "use_cache": False})
        with default_dtype(torch.bfloat16), torch.device("meta"):
            model = spec.build()
        inputs = spec.example_inputs(BATCH, seq)
        graph = profile_module(model, inputs, mode="fake")
        per_block[seq] = _block(graph, "encoder.block.1")
    heads = T5["num_heads"]
    bias = lambda s: heads * s * s * 2 // BATCH  # noqa: E731  bf16 bias, per sample
    assert per_block[64] - bias(64) == 2 * (per_block[32] - bias(32))


def test_a_learned_bias_gets_the_gradient_of_the_math_kernel():
    """Where a GPU runs the memory-efficient kernel with a bias that needs a gradient, the profile's
    stand-in (fused CPU kernel, bias gradient one head at a time) computes the gradients of
    PyTorch's math kernel, and saves no attention matrix but the bias."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, requires_grad=True) for _ in "qkv")
    bias = torch.randn(1, 3, 8, 8, requires_grad=True)
    grads, saved = [], []
    for mode in (contextlib.nullcontext(), CudaLikeAttention()):
        shapes: list[tuple] = []
        with mode, torch.autograd.graph.saved_tensors_hooks(_shape_into(shapes), lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v, bias)))
        saved.append(sorted(shapes))
    for expected, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected)
    assert saved[1] == sorted([(1, 3, 8, 8), *[(2, 3, 8, 16)] * 4, (2, 3, 8)])


def _shape_into(shapes: list):
    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    return pack


def test_attention_dropout_keeps_no_mask():
    """A fused kernel with dropout saves q, k, v, its output and the log-sum-exp, as without, and
    the flash kernel's RNG state (``rng_state``, ``unused``), which it keeps at dropout 0 too."""
    q, k, v = (torch.randn(2, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    shapes = []

    def pack(tensor):
        shapes.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with CudaLikeAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
    assert sorted(shapes, key=str) == sorted(
        [((2, 4, 32, 16), torch.bfloat16)] * 4
        + [((2, 4, 32), torch.float32), ((2,), torch.uint64), ((), torch.uint64)],
        key=str,
    )


def test_hf_models_are_built_with_flash_semantics_attention():
    """transformers' attention interface gets the flash contract (profiling/hf/attention.py);
    a class without the interface but with SDPA keeps SDPA."""
    assert hf_spec("gpt2").config._attn_implementation == FUSED
    assert hf_spec("t5-base").config._attn_implementation == "sdpa"
