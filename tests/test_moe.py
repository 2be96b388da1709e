"""Mixture-of-experts: the zoo's MoE block (models/moe.py) against a per-token reference, its
static shapes, the presets' parameter counts, and the profiler's expert fields."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import models  # noqa: E402
from models.moe import MoE, expert_capacity  # noqa: E402
from profiling._torch_compat import FakeTensorMode  # noqa: E402


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
            gate, up = (experts.fc1_weight[e] @ x[t]).chunk(2)
            out[t] += w * (experts.fc2_weight[e] @ (F.silu(gate) * up))
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


def test_moe_runs_on_meta_and_under_fake_tensors():
    spec = models.get("moe-tiny")
    with FakeTensorMode():
        model = spec.build()
        loss = model(*spec.example_inputs(2, None))
        loss.backward()
        assert model.layers[0].mlp.experts.fc1_weight.grad.shape == (4, 128, 32)
    with torch.device("meta"):
        model = spec.build()
        model(*spec.example_inputs(2, None)).backward()
