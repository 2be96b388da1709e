"""Mixture-of-experts: the zoo's MoE block (models/moe.py) against a per-token reference, its
static shapes, the presets' parameter counts, and the profiler's expert fields."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import models  # noqa: E402
from models.moe import MoE, _WeightedSwiGLU, capacity_experts_forward, expert_capacity  # noqa: E402
from profiling._torch_compat import FakeTensorMode, TorchDispatchMode, tree_flatten  # noqa: E402


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_model(name: str, **overrides):
    spec = models.get(name, **overrides)
    with torch.device("meta"):
        return spec, spec.build()


# -- presets: parameter counts to the parameter ---------------------------------------------


def test_mixtral_8x7b_parameter_count():
    """46.7B (Jiang et al. 2024): per block attention 2 h^2 + 2 h (8 x 128) = 41,943,040, 8
    experts of 3 h 14336 = 1,409,286,144, router 8 h, 2 norms; embedding and head V h each."""
    spec, model = meta_model("mixtral-8x7b")
    h, v, f, experts = 4096, 32000, 14336, 8
    block = 2 * h * h + 2 * h * 1024 + experts * 3 * h * f + experts * h + 2 * h
    assert numel(model.layers[0]) == block
    assert numel(model) == 32 * block + 2 * v * h + h == 46_702_792_704
    assert spec.config.top_k == 2 and spec.config.rope_theta == 1e6
    assert not spec.config.router_pre_softmax


def test_deepseek_moe_16b_parameter_count():
    """16.4B (Dai et al. 2024): block 0 dense (width 10944); 27 blocks of 64 routed + 2 shared
    experts of width 1408 and a 64 x h router; vocabulary 102400, untied."""
    spec, model = meta_model("deepseek-moe-16b")
    h, v = 2048, 102400
    attention, norms = 4 * h * h, 2 * h
    dense = attention + 3 * h * 10944 + norms
    moe = attention + 64 * 3 * h * 1408 + 3 * h * 2 * 1408 + 64 * h + norms
    assert numel(model.layers[0]) == dense and numel(model.layers[1]) == moe
    assert numel(model) == dense + 27 * moe + 2 * v * h + h == 16_375_728_128
    assert [spec.config.is_moe_block(i) for i in (0, 1, 27)] == [False, True, True]
    assert spec.config.router_pre_softmax


def test_expert_parameters_live_under_experts():
    _, model = meta_model("deepseek-moe-16b")
    names = [name for name, _ in model.layers[1].named_parameters()]
    routed = [name for name in names if "experts" in name.split(".")]
    assert routed == ["mlp.experts.fc1_weight", "mlp.experts.fc2_weight"]
    assert "mlp.router.weight" in names and "mlp.shared_experts.fc1.weight" in names
    assert sum(p.numel() for n, p in model.layers[1].named_parameters() if n in routed) == (
        64 * 3 * 2048 * 1408
    )


def test_moe_tiny_shape():
    spec, model = meta_model("moe-tiny")
    config = spec.config
    assert (config.num_experts, config.top_k, config.expert_ffn_width) == (4, 2, 64)
    assert all(isinstance(block.mlp, MoE) for block in model.layers)
    # block: attention 2 h^2 + 2 h (2 x 8) + experts 4 x 3 h 64 + router 4 h + 2 norms
    assert numel(model.layers[0]) == 2 * 32 * 32 + 2 * 32 * 16 + 4 * 3 * 32 * 64 + 4 * 32 + 64


def test_bad_moe_config_names_the_field():
    with pytest.raises(ValueError, match=r"top_k \(5\) > num_experts \(4\)"):
        models.get("moe-tiny", top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        models.get("moe-tiny", capacity_factor=0.0)


# -- the block against a per-token reference -------------------------------------------------


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum over the token's top-k experts of weight * SwiGLU expert(token), token by token."""
    experts = moe.experts
    out = torch.zeros_like(x)
    logits = x @ moe.router.weight.T
    for t in range(x.shape[0]):
        if moe.router.pre_softmax:
            weights, chosen = torch.softmax(logits[t], -1).topk(moe.router.top_k)
        else:
            top, chosen = logits[t].topk(moe.router.top_k)
            weights = torch.softmax(top, -1)
        for w, e in zip(weights, chosen, strict=True):
            gate, up = (x[t] @ experts.fc1_weight[e]).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ experts.fc2_weight[e])
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(router_pre_softmax=True, shared_experts=1, top_k=3)],
    ids=["mixtral-like", "deepseek-like"],
)
def test_moe_matches_per_token_reference_without_drops(overrides):
    """capacity_factor E / k: every expert can take every token, so nothing is dropped."""
    config = models.get("moe-tiny", **overrides).config
    config.capacity_factor = config.num_experts / config.top_k
    torch.manual_seed(0)
    moe = MoE(config)
    x = torch.randn(1, 12, config.hidden)
    got = moe(x)
    torch.testing.assert_close(got, reference_moe(moe, x[0]).unsqueeze(0))
    got.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.parameters())


def test_capacity_keeps_the_most_probable_tokens():
    """All tokens prefer expert 0 (top-1 of 4 after a softmax over all 4, 8 tokens: capacity
    2): expert 0 keeps the two
    tokens with the highest probability, the others are dropped (output 0 without shared
    experts)."""
    config = models.get("moe-tiny", top_k=1, router_pre_softmax=True).config
    moe = MoE(config)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 1.0
    x = torch.randn(8, config.hidden)
    x[:, 0] = torch.arange(8.0) + 1  # token 7, then 6, have the largest logit for expert 0
    out = moe(x.unsqueeze(0))[0]
    assert expert_capacity(8, top_k=1, num_experts=4, capacity_factor=1.0) == 2
    kept = out.abs().sum(-1) > 0
    assert kept.tolist() == [False] * 6 + [True] * 2


def test_capacity_formula():
    # Megatron's get_capacity: ceil(tokens * k / E * CF), at most the token count
    assert expert_capacity(4096, top_k=2, num_experts=8, capacity_factor=1.0) == 1024
    assert expert_capacity(10, top_k=6, num_experts=64, capacity_factor=1.0) == 1
    assert expert_capacity(10, top_k=2, num_experts=4, capacity_factor=1.25) == 7
    assert expert_capacity(10, top_k=2, num_experts=4, capacity_factor=4.0) == 10


@pytest.mark.slow
def test_moe_runs_on_meta_and_under_fake_tensors():
    spec = models.get("moe-tiny")
    with FakeTensorMode():
        model = spec.build()
        loss = model(*spec.example_inputs(2, None))
        loss.backward()
        assert model.layers[0].mlp.experts.fc1_weight.grad.shape == (4, 32, 128)
    with torch.device("meta"):
        model = spec.build()
        model(*spec.example_inputs(2, None)).backward()


# -- the weighting inside the activation, as megatron-core does ------------------------------


def weighted_after_fc2(experts, hidden, indices, weights):
    """The same experts weighting their outputs after fc2 (transformers' order, the zoo's
    before megatron-core's weighted activation): the reference for the math."""
    from models.common import _SwiGLU

    activation = {"swiglu": _SwiGLU.apply, "gelu": F.gelu, "relu": F.relu}[experts.kind]
    return capacity_experts_forward(
        hidden,
        indices,
        weights,
        fc1_weight=experts.fc1_weight,
        fc2_weight=experts.fc2_weight,
        fc1_bias=experts.fc1_bias,
        fc2_bias=experts.fc2_bias,
        activation=activation,
        capacity_factor=experts.capacity_factor,
    )


@pytest.mark.parametrize(
    ("mlp", "bias", "capacity_factor"),
    [("swiglu", False, 1.0), ("swiglu", True, 2.0), ("gelu", True, 1.0), ("relu", False, 1.25)],
)
def test_weighted_activation_equals_weighting_after_fc2(mlp, bias, capacity_factor):
    """Output and every gradient (input, router, expert weights and biases) of the zoo block
    equal those of weighting the experts' outputs after fc2, dropping and padding included
    (capacity factor 1 with a random routing drops tokens)."""
    config = models.get("moe-tiny", mlp=mlp, bias=bias, capacity_factor=capacity_factor).config
    torch.manual_seed(0)
    moe = MoE(config).double()
    x = torch.randn(24, config.hidden, dtype=torch.float64, requires_grad=True)
    results = []
    for forward in (moe.experts, lambda *a: weighted_after_fc2(moe.experts, *a)):
        weights, indices = moe.router(x)
        out = forward(x, indices, weights)
        grads = torch.autograd.grad(
            out.sin().sum(), [x, *moe.router.parameters(), *moe.experts.parameters()]
        )
        results.append((out, grads))
    (out, grads), (ref_out, ref_grads) = results
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


def test_weighted_swiglu_saves_its_input_and_the_weights():
    """megatron-core's WeightedSwiGLUFunction saves (input, weights), and nothing else; its
    gradients pass gradcheck (the weights' gradient is summed over the row)."""
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(3, 5, 1, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _WeightedSwiGLU.apply(x, weights)
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), weights.data_ptr()]
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up * weights)
    assert torch.autograd.gradcheck(_WeightedSwiGLU.apply, (x, weights))


class NewStorages(TorchDispatchMode):
    """Records (op, bytes) of every storage an op returns that no earlier op saw."""

    def __init__(self):
        super().__init__()
        self.seen, self.new = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.new.append((func.__name__, t.untyped_storage().nbytes()))
        return out


def test_weighted_swiglu_allocates_only_its_results():
    """As megatron-core's compiled (fused) weighted_swiglu and weighted_swiglu_back on a GPU:
    the forward allocates its (E, C, f) result, the backward the (E, C, 2f) input gradient and
    the (E, C, 1) weights' gradient, nothing else (fp32: E 4, C 6, f 8)."""
    x = torch.randn(4, 6, 16, requires_grad=True)
    weights = torch.rand(4, 6, 1, requires_grad=True)
    grad = torch.randn(4, 6, 8)
    forward, backward = NewStorages(), NewStorages()
    with forward:
        out = _WeightedSwiGLU.apply(x, weights)
    with backward:
        out.backward(grad)
    assert forward.new == [("silu.default", 4 * 4 * 6 * 8)]
    assert sorted(nbytes for _, nbytes in backward.new) == [4 * 4 * 6, 4 * 4 * 6 * 16]


def test_bf16_weighted_swiglu_matches_megatron_core(monkeypatch):
    """The same bf16 output and gradients as megatron-core's own weighted_bias_swiglu_impl
    (its jit_fuser functions run uncompiled, as the megatron engine runs them on the CPU)."""
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_swiglu")
    for name, value in list(vars(fused).items()):
        if callable(original := getattr(value, "_torchdynamo_orig_callable", None)):
            monkeypatch.setattr(fused, name, original)
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    weights = torch.rand(64, 1, dtype=torch.bfloat16)
    grad = torch.randn(64, 16, dtype=torch.bfloat16)
    results = []
    for apply in (_WeightedSwiGLU.apply, lambda a, w: fused.weighted_bias_swiglu_impl(a, None, w)):
        a, w = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = apply(a, w)
        out.backward(grad)
        results.append((out, a.grad, w.grad))
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


# -- the profiler's expert fields ------------------------------------------------------------

BATCH, SEQ, D = 2, 16, 2  # moe-tiny profiled in bf16: T = 32 tokens per micro-batch
TOKENS, E, K, H, F_WIDTH = BATCH * SEQ, 4, 2, 32, 64
CAPACITY = 16  # ceil(32 x 2 / 4): balanced, E C = T k


def zoo_expert_saved_bytes(
    *, tokens=TOKENS, capacity=CAPACITY, experts=E, hidden=H, f=F_WIDTH, d=D
) -> int:
    """Hand count of what the zoo's routed SwiGLU experts save (models/moe.py), batch total:
    what megatron-core's experts save (the weighted SwiGLU keeps fc1's output and the
    probabilities; the experts' outputs are not saved)."""
    rows = experts * capacity
    return (
        8 * capacity * experts * (capacity < tokens)  # int64 indices of the capacity top-k
        + tokens * experts  # bool capacity map
        + 2 * 8 * rows  # int64 permutation indices, and those of the permuted probabilities
        + d * rows * hidden  # permuted tokens (fc1's input)
        + d * rows * 2 * f  # fc1 output (saved by the weighted SwiGLU)
        + d * rows  # permuted probabilities (saved by the weighted SwiGLU)
        + d * rows * f  # fc2 input: the weighted activation
    )


def profile(name: str, **overrides):
    from profiling.export import export_graph

    graph = export_graph(name, batch=BATCH, dtype="bf16", overrides=overrides)
    return graph, {layer.name: layer for layer in graph.layers}


@pytest.mark.slow
def test_profile_moe_tiny_expert_fields_byte_exact():
    graph, layers = profile("moe-tiny")
    block = layers["layers.0"]
    assert block.expert_params == E * 3 * H * F_WIDTH == 24_576
    assert block.expert_activation_bytes * BATCH == zoo_expert_saved_bytes() == 30_464
    # the backward's extra peak: the weighted SwiGLU's input gradient (E C 2f d) and weights'
    # gradient (E C d), all that megatron-core's fused weighted_swiglu_back allocates; at the
    # weight gradients, until the node that made fc2's returns: the gradient of fc2's output
    # (E C h d) and the input gradient the same node makes after it (E C f d)
    assert block.transient_bytes * BATCH == E * CAPACITY * (2 * F_WIDTH + 1) * D == 16_512
    assert block.weight_grad_transient_bytes * BATCH == E * CAPACITY * (H + F_WIDTH) * D == 12_288
    # dispatch + combine all-to-all, forward + backward: 4 E C h d per micro-batch
    assert block.ep_comm_bytes * BATCH == 4 * E * CAPACITY * H * D == 16_384
    assert layers["layers.1"].expert_activation_bytes == block.expert_activation_bytes
    assert layers["embed"].expert_params == layers["head"].ep_comm_bytes == 0
    assert graph.meta["moe"] | {"expert_fields": None} == {
        "num_experts": 4,
        "top_k": 2,
        "shared_experts": 0,
        "capacity_factor": 1.0,
        "expert_fields": None,
        "expert_ffn_hidden": F_WIDTH,  # one routed expert's MLP width (Megatron's export)
        "shared_expert_ffn_hidden": 0,
    }


@pytest.mark.parametrize(("mlp", "kept"), [("gelu", 3), ("relu", 2)])
def test_profile_gelu_and_relu_experts_save_what_megatron_cores_mlp_saves(mlp, kept):
    """megatron-core's expert MLP without a fused weighted activation: act(fc1) then
    ``* per_token_scale`` (MLP.forward). GeLU keeps its input, the multiplication its output
    (and the weights), fc2 the product: 3 E C f d; ReLU's input is its output: 2 E C f d."""
    _, layers = profile("moe-tiny", mlp=mlp)
    rows = E * CAPACITY
    swiglu = D * rows * 3 * F_WIDTH  # fc1 output (2f) and fc2 input (f)
    expected = zoo_expert_saved_bytes() - swiglu + kept * D * rows * F_WIDTH
    assert layers["layers.0"].expert_activation_bytes * BATCH == expected


def test_profile_moe_tp_split_of_the_rest_of_the_block():
    """DeepSeek-like moe-tiny: block 0 dense, block 1 MoE with one shared expert of the dense
    MLP's width. Attention and the shared expert split as a dense block's attention and MLP;
    the router and the routed experts stay out of the TP split."""
    graph, layers = profile("moe-tiny", shared_experts=1, dense_layers=1, router_pre_softmax=True)
    dense, moe = layers["layers.0"], layers["layers.1"]
    roles = graph.meta["tp_roles"]
    assert roles["layers.1.mlp.shared_experts.fc1"] == "column"
    assert roles["layers.1.mlp.shared_experts.fc2"] == "row"
    assert not [path for path in roles if "router" in path or "mlp.experts" in path]
    assert moe.tp_params == dense.tp_params == 3072 + 3 * H * F_WIDTH
    assert moe.tp_activation_bytes == dense.tp_activation_bytes
    assert moe.tp_comm_bytes == dense.tp_comm_bytes
    assert moe.params == moe.tp_params + moe.expert_params + E * H + 2 * H  # + router, norms
    assert moe.expert_activation_bytes * BATCH == zoo_expert_saved_bytes()
    assert moe.expert_activation_bytes + moe.tp_activation_bytes < moe.activation_bytes
    assert dense.expert_params == dense.expert_activation_bytes == dense.ep_comm_bytes == 0
    assert graph.meta["moe"]["shared_experts"] == 1


@pytest.mark.slow
def test_profile_expert_fields_follow_the_capacity_factor():
    """capacity_factor 1.5: C = ceil(1.5 x 16) = 24 tokens per expert."""
    _, layers = profile("moe-tiny", capacity_factor=1.5)
    block = layers["layers.0"]
    assert block.ep_comm_bytes * BATCH == 4 * E * 24 * H * D
    assert block.expert_activation_bytes * BATCH == zoo_expert_saved_bytes(capacity=24)


# -- transformers' MoE models ----------------------------------------------------------------

TINY_HF = {
    "mixtral-8x7b": {
        "num_hidden_layers": 2,
        "hidden_size": H,
        "intermediate_size": F_WIDTH,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": E,
        "vocab_size": 96,
        "max_position_embeddings": SEQ,
    },
    "qwen1.5-moe-a2.7b": {
        "num_hidden_layers": 2,
        "hidden_size": H,
        "intermediate_size": F_WIDTH,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": E,
        "num_experts_per_tok": K,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 96,
        "max_position_embeddings": SEQ,
    },
}
"""The bundled MoE configs shrunk by size overrides (Mixtral keeps top-2)."""


def test_hf_moe_configs_are_bundled():
    from profiling.hf.config import bundled_configs

    assert {"mixtral-8x7b", "qwen1.5-moe-a2.7b"} <= set(bundled_configs())


@pytest.mark.slow
def test_hf_mixtral_profiles_through_the_capacity_dispatch():
    """Mixtral's experts run the zoo's dispatch with transformers' weights and gate, weighting
    the experts' outputs after fc2 as transformers does (so they are saved, E C h); the gate
    keeps act(gate) beside its input (the zoo's fused SwiGLU keeps only the input), and the
    router's weights are fp32 (so are the permuted probabilities); the rest is byte for byte
    the zoo's hand count."""
    pytest.importorskip("transformers")
    graph, layers = profile("hf:mixtral-8x7b", **TINY_HF["mixtral-8x7b"])
    block = layers["model.layers.0"]
    rows = E * CAPACITY
    assert block.expert_params == E * 3 * H * F_WIDTH
    assert block.ep_comm_bytes * BATCH == 4 * rows * H * D
    # expert outputs saved by the weighting; act(gate) kept; fp32 permuted probabilities
    extra = D * rows * H + D * rows * F_WIDTH + (4 - D) * rows
    assert block.expert_activation_bytes * BATCH == zoo_expert_saved_bytes() + extra == 42_880
    assert graph.meta["moe"]["num_experts"] == E and graph.meta["moe"]["top_k"] == 2
    assert graph.meta["training_settings"]["experts_implementation"].startswith("capacity")
    assert not [path for path in graph.meta["tp_roles"] if "experts" in path]


@pytest.mark.slow
def test_hf_qwen_moe_shared_expert_and_gate():
    """Qwen-MoE: the shared expert (2 routed experts' width here) splits like a dense MLP, its
    sigmoid gate Linear(h, 1) stays replicated; meta counts it as 2 shared experts."""
    pytest.importorskip("transformers")
    graph, layers = profile("hf:qwen1.5-moe-a2.7b", **TINY_HF["qwen1.5-moe-a2.7b"])
    block = layers["model.layers.0"]
    assert block.expert_params == E * 3 * H * 16
    assert block.ep_comm_bytes * BATCH == 4 * E * CAPACITY * H * D
    roles = graph.meta["tp_roles"]
    assert roles["model.layers.0.mlp.shared_expert.down_proj"] == "row"
    assert "model.layers.0.mlp.shared_expert_gate" not in roles
    # q, k, v (with biases) column-parallel, o row-parallel; the shared expert 3 h 32
    assert block.tp_params == 4 * H * H + 3 * H + 3 * H * 32
    assert graph.meta["moe"] == graph.meta["moe"] | {"num_experts": E, "shared_experts": 2}


@pytest.mark.slow
def test_capacity_experts_equal_transformers_eager_without_drops():
    """With capacity factor E / k nothing is dropped: transformers' Mixtral block computes the
    same output and gradients through the capacity dispatch as through its own eager loop."""
    transformers = pytest.importorskip("transformers")
    from profiling.hf._transformers_compat import use_capacity_experts

    config = transformers.MixtralConfig(
        **TINY_HF["mixtral-8x7b"], experts_implementation="eager", use_cache=False
    )
    torch.manual_seed(0)
    eager = transformers.MixtralForCausalLM(config)
    capacity_config = transformers.MixtralConfig(**TINY_HF["mixtral-8x7b"], use_cache=False)
    assert use_capacity_experts(capacity_config, transformers.MixtralForCausalLM)
    capacity = transformers.MixtralForCausalLM(capacity_config)
    capacity.load_state_dict(eager.state_dict())
    for layer in capacity.model.layers:
        layer.mlp.experts.capacity_factor = E / 2
    ids = torch.randint(96, (2, SEQ))
    losses = [model(input_ids=ids, labels=ids).loss for model in (eager, capacity)]
    torch.testing.assert_close(losses[1], losses[0])
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(
        capacity.model.layers[0].mlp.experts.gate_up_proj.grad,
        eager.model.layers[0].mlp.experts.gate_up_proj.grad,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "params", "num_blocks", "expert_params"),
    [
        ("hf:mixtral-8x7b", 46_702_792_704, 32, 8 * 3 * 4096 * 14336),
        ("hf:qwen1.5-moe-a2.7b", 14_315_784_192, 24, 60 * 3 * 2048 * 1408),
    ],
)
def test_hf_moe_full_size_on_fake_tensors(name, params, num_blocks, expert_params):
    """Full size (about 3 s each of profiling, plus building on meta)."""
    from profiling.export import export_graph

    graph = export_graph(name, batch=1, seq=1024)
    blocks = [layer for layer in graph.layers if layer.expert_params]
    assert sum(layer.params for layer in graph.layers) == params
    assert len(blocks) == num_blocks
    assert all(layer.expert_params == expert_params for layer in blocks)
    k, num_experts = graph.meta["moe"]["top_k"], graph.meta["moe"]["num_experts"]
    capacity = expert_capacity(1024, top_k=k, num_experts=num_experts, capacity_factor=1.0)
    hidden = 4096 if "mixtral" in name else 2048
    assert all(layer.ep_comm_bytes == 4 * num_experts * capacity * hidden * 2 for layer in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe-tiny", "hf:mixtral-8x7b"])
def test_fake_profile_equals_real_cpu_run(name):
    """The static shapes make the fake profile exact: every field of a real CPU run (times
    aside) is the same."""
    from profiling.export import export_graph

    overrides = TINY_HF.get(name.removeprefix("hf:"), {})
    fake, real = (
        export_graph(name, batch=BATCH, overrides=overrides, device=device)
        for device in ("meta", "cpu")
    )
    for a, b in zip(fake.layers, real.layers, strict=True):
        assert {**vars(a), "fwd_ms": None, "bwd_ms": None} == {
            **vars(b),
            "fwd_ms": None,
            "bwd_ms": None,
        }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "experts", "top_k", "hidden", "f", "first_moe"),
    [("mixtral-8x7b", 8, 2, 4096, 14336, 0), ("deepseek-moe-16b", 64, 6, 2048, 1408, 1)],
)
def test_zoo_moe_full_size_expert_fields(name, experts, top_k, hidden, f, first_moe):
    """Seq 4096, batch 1, bf16: Mixtral C = 1024 (771,997,696 saved bytes per block),
    DeepSeek-MoE C = 384 (309,182,464)."""
    from profiling.export import export_graph

    graph = export_graph(name, batch=1)
    blocks = [layer for layer in graph.layers if layer.name.startswith("layers.")]
    capacity = expert_capacity(4096, top_k=top_k, num_experts=experts, capacity_factor=1.0)
    saved = zoo_expert_saved_bytes(
        tokens=4096, capacity=capacity, experts=experts, hidden=hidden, f=f
    )
    assert saved == {"mixtral-8x7b": 771_997_696, "deepseek-moe-16b": 309_182_464}[name]
    for block in blocks[first_moe:]:
        assert block.expert_params == experts * 3 * hidden * f
        assert block.expert_activation_bytes == saved
        assert block.ep_comm_bytes == 4 * experts * capacity * hidden * 2
    assert all(block.expert_params == 0 for block in blocks[:first_moe])


def test_expert_weight_gradients_come_in_the_parameters_layout():
    """Autograd hands AccumulateGrad contiguous expert-weight gradients (zoo and transformers'
    layouts alike), so the first accumulation keeps them without a gradient-sized copy, and no
    gradient waits in a transpose's node while others are made (``models.moe.expert_matmul``).
    Before, bmm with transposed (E, out, in) weights added a 64 KiB fp32 copy to the profiled
    weight-gradient transient of moe-tiny's blocks and the executor over-predicted by 6-8%."""
    transformers = pytest.importorskip("transformers")
    from profiling.hf._transformers_compat import use_capacity_experts

    spec = models.get("moe-tiny")
    zoo = spec.build()
    config = transformers.MixtralConfig(**TINY_HF["mixtral-8x7b"], use_cache=False)
    assert use_capacity_experts(config, transformers.MixtralForCausalLM)
    hf = transformers.MixtralForCausalLM(config)
    ids, targets = spec.example_inputs(2, None)
    for loss, experts in (
        (zoo(ids, targets), zoo.layers[0].mlp.experts),
        (hf(input_ids=ids, labels=ids).loss, hf.model.layers[0].mlp.experts),
    ):
        weights = [p for p in experts.parameters() if p.dim() == 3]
        grads = torch.autograd.grad(loss, weights)
        assert len(grads) == 2 and all(g.is_contiguous() for g in grads)
