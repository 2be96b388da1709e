"""Mixture-of-experts MLP as Megatron-core's ``MoELayer`` computes it, with static shapes.

    moe = MoE(config)                  # Block.mlp of a block with config.is_moe_block(i)
    y = moe(x)                         # (b, s, h) -> (b, s, h)

Module paths (Megatron-core's names, so the megatron engine builds the same parameters):

    router.weight           (E, h)              TopKRouter: logits = x W^T, no bias
    experts.fc1_weight      (E, h, 2f or f)     routed experts (GroupedMLP's weight1 viewed
    experts.fc2_weight      (E, f, h)           (E, h, -1)), fc1 = [gate | up]; with config.bias
                                                also fc1_bias (E, 2f or f), fc2_bias (E, h)
    shared_experts.fc1/fc2  one MLP of width shared_experts * f (SharedExpertMLP; DeepSeek)

The routed experts' parameters live under the submodule ``experts`` (the profiler counts them
as ``expert_params`` by that name). Each routed expert is an MLP of kind ``config.mlp`` and width
``config.expert_ffn_width``: with E experts, 3 h f (SwiGLU) or 2 h f (GeLU/ReLU) weights each.

**Routing** (``megatron.core.transformer.moe.moe_utils.topk_softmax_with_capacity``):

- ``router_pre_softmax=False`` (Megatron's default; Mixtral): top-k of the logits, softmax over
  those k, so each token's k weights sum to 1 (= HF Mixtral's softmax, top-k, renormalise).
- ``router_pre_softmax=True`` (``--moe-router-pre-softmax``; DeepSeek-MoE): softmax over all E
  experts, then top-k; the weights are not renormalised.

The softmax runs in fp32 and its result is cast back to the input dtype, as Megatron does.

**Dispatch with a capacity** (``--moe-expert-capacity-factor CF --moe-pad-expert-input-to-capacity
--moe-token-drop-policy probs``): each expert takes C = min(ceil(CF * T * k / E), T) of the
micro-batch's T tokens, those with the highest routing probability (tokens over the capacity
are dropped), and its input is padded to C with tokens of probability 0. So every shape depends
only on (T, E, k, CF), never on the routing: the layer runs under FakeTensorMode and on meta,
and its memory is the same for any routing. At CF = 1 and a balanced routing (every expert
chosen by T k / E tokens) nothing is dropped or padded.

**Saved for backward** by the routed experts (``experts``; T tokens, C capacity, d bytes per
element; the expert terms scale with E C = T k at CF 1):

    8 C E       int64 indices of the capacity top-k (C < T only)
    T E         bool capacity map (probs * map)
    8 E C x 2   int64 token indices of the permutation, and of the permuted probabilities
    d E C h     permuted tokens (fc1's input: what the dispatch all-to-all sends)
    d E C 2f    fc1 output, saved by the weighted SwiGLU (GeLU: d E C f, the activation's input,
                and d E C f, its output, saved by the weighting; ReLU: only its output, d E C f)
    d E C       permuted probabilities, saved by the weighted activation
    d E C f     fc2's input: the weighted activation

The routing weights are multiplied into the activation, before fc2, as Megatron-core's experts
do (``megatron/core/transformer/mlp.py`` ``MLP.forward(per_token_scale=...)``, which
``SequentialMLP`` calls, and ``TEGroupedMLP.forward``'s ``bias_act_func`` in
``megatron/core/transformer/moe/experts.py``): for SwiGLU the fused
``weighted_bias_swiglu_impl`` (``megatron/core/fusions/fused_bias_swiglu.py``,
``WeightedSwiGLUFunction``: :class:`_WeightedSwiGLU` here) saves only its input and the
weights; for GeLU and ReLU the activation is followed by a plain multiplication, as that
``MLP.forward`` does. So the experts' outputs (d E C h, what the combine all-to-all sends) are
not saved; a bias of fc2 is weighted too (``output += output_bias * per_token_scale``), so the
sum over k of weight * expert(token) is unchanged. transformers' MoE models (the ``hf:``
exports, ``weighted_activation=None``) weight the experts' outputs after fc2, as transformers
does, and save them (d E C h).

The router saves its input (shared with the shared experts), the top-k indices (8 T k) and the
fp32 softmax (4 T k, or 4 T E with pre-softmax).

The auxiliary load-balancing loss is left out: it changes neither the shapes nor, beyond a few
(T, E) tensors of the router, the memory, and the capacity already bounds every expert's load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common import MLP, Dropout

WeightedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(fc1's output (E, C, out), permuted probabilities (E, C, 1)) -> weighted activation
(E, C, f)."""


def expert_capacity(tokens: int, *, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens each expert takes from a micro-batch of ``tokens``: Megatron-core's
    ``get_capacity(tokens * top_k, num_experts, capacity_factor)``, at most ``tokens``."""
    return min(math.ceil(tokens * top_k / num_experts * capacity_factor), tokens)


def route(
    logits: torch.Tensor, *, top_k: int, pre_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights, indices), each (T, k); see the module docstring."""
    if pre_softmax:
        scores = F.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        weights, indices = torch.topk(scores, top_k, dim=-1)
        return weights, indices
    scores, indices = torch.topk(logits, top_k, dim=-1)
    return F.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits), indices


def capacity_experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    capacity_factor: float,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    out_in: bool = False,
    weighted_activation: WeightedActivation | None = None,
) -> torch.Tensor:
    """Routed experts of (T, h) tokens, each routed to the ``top_k_index`` experts with weights
    ``top_k_weights`` (T, k): sum over k of weight * expert(token), with Megatron's
    drop-and-pad dispatch (module docstring). Weights as Megatron's GroupedMLP stores them,
    ``fc1_weight`` (E, h, out) and ``fc2_weight`` (E, f, h), or with ``out_in`` as
    transformers' fused experts do, (E, out, h) and (E, h, f) (:func:`expert_matmul`);
    ``weighted_activation`` (Megatron-core's experts, the zoo's; module docstring) maps fc1's
    output (E, C, out) and the routing weights (E, C, 1) to the weighted activation (E, C, f),
    fc2's input; or ``activation`` (transformers') maps fc1's output to (E, C, f) and the
    experts' outputs are weighted after fc2. Exactly one of the two is given. Returns (T, h) in
    ``hidden``'s dtype."""
    if (activation is None) == (weighted_activation is None):
        raise TypeError("capacity_experts_forward: give one of activation, weighted_activation")
    tokens, hidden_size = hidden.shape
    num_experts, top_k = fc1_weight.shape[0], top_k_index.shape[-1]
    capacity = expert_capacity(
        tokens, top_k=top_k, num_experts=num_experts, capacity_factor=capacity_factor
    )
    # dense (T, E) probabilities of the chosen experts (router's topk_masked_gates)
    probs = torch.zeros(
        tokens, num_experts, dtype=top_k_weights.dtype, device=hidden.device
    ).scatter(1, top_k_index, top_k_weights)
    if capacity < tokens:  # apply_router_token_dropping, drop policy "probs", padded
        _, kept = torch.topk(probs, k=capacity, dim=0, sorted=False)
        routing_map = torch.zeros_like(probs).scatter(0, kept, 1).bool()
    else:
        routing_map = torch.ones_like(probs, dtype=torch.bool)
    probs = probs * routing_map
    # permute (drop_and_pad): per expert the indices of its C tokens, (E C,)
    sorted_indices = (
        routing_map.to(torch.int8)
        .T.contiguous()
        .argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        .contiguous()
        .view(-1)
    )
    expert_rows = torch.arange(num_experts, device=hidden.device).unsqueeze(-1) * tokens
    probs_index = (expert_rows + sorted_indices.view(num_experts, capacity)).view(-1)
    permuted_probs = probs.T.contiguous().view(-1).index_select(0, probs_index)
    permuted = hidden.index_select(0, sorted_indices).view(num_experts, capacity, hidden_size)
    # the experts: two batched matmuls (GroupedMLP)
    x = expert_matmul(permuted, fc1_weight, fc1_bias, out_in=out_in)
    if weighted_activation is not None:  # Megatron-core: weight inside the activation
        weights = permuted_probs.view(num_experts, capacity, 1)
        out = expert_matmul(weighted_activation(x, weights), fc2_weight, out_in=out_in)
        if fc2_bias is not None:  # MLP.forward: output += output_bias * per_token_scale
            out = out + fc2_bias.unsqueeze(1) * weights
        out = out.reshape(num_experts * capacity, hidden_size)
    else:  # transformers: weight the experts' outputs
        out = expert_matmul(activation(x), fc2_weight, fc2_bias, out_in=out_in)
        out = out.reshape(num_experts * capacity, hidden_size) * permuted_probs.unsqueeze(-1)
    # unpermute: scatter-add back to the tokens
    combined = torch.zeros(tokens, hidden_size, dtype=out.dtype, device=hidden.device)
    combined = combined.scatter_add(0, sorted_indices.unsqueeze(1).expand(-1, hidden_size), out)
    return combined.to(hidden.dtype)


def expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out_in: bool
) -> torch.Tensor:
    """x (E, C, in) times each expert's weight [+ bias (E, out)] -> (E, C, out).

    ``out_in=False``: weight (E, in, out), ``bmm(x, weight)`` (Megatron's GroupedMLP layout, the
    zoo's). ``out_in=True``: weight stored (E, out, in) (transformers'), multiplied as
    ``bmm(weight, x^T)^T`` with the parameter itself as bmm's operand: autograd returns its
    gradient contiguous, in the parameter's layout, straight to AccumulateGrad. Multiplying by
    a transposed view instead (``bmm(x, weight.transpose(1, 2))``) returns a transposed
    gradient, which the first accumulation copies into the parameter's layout (a
    gradient-sized temporary), and delays its accumulation until the engine reaches the
    transpose's node (the gradient waits, live, while earlier layers' gradients are made). The
    output is then a transposed view of an (E, out, C) tensor."""
    if out_in:
        out = torch.bmm(weight, x.transpose(1, 2)).transpose(1, 2)
    else:
        out = torch.bmm(x, weight)
    return out if bias is None else out + bias.unsqueeze(1)


class _WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * weights of the fused [gate, up] projection x (..., 2f) and per-row
    routing weights (..., 1), keeping only x and the weights for the backward: Megatron-core's
    ``WeightedSwiGLUFunction`` (``megatron/core/fusions/fused_bias_swiglu.py``, reached through
    ``weighted_bias_swiglu_impl``), which its experts run with ``--swiglu`` and
    ``bias_activation_fusion``. The weights' gradient is summed over the row, as
    ``weighted_swiglu_back`` does.

    Megatron compiles ``weighted_swiglu`` and ``weighted_swiglu_back`` (``jit_fuser``: one
    fused kernel each on a GPU), so they allocate only their results: (..., f) forward;
    (..., 2f) and (..., 1) backward. This one allocates the same, computing in place in its
    results (eager elementwise ops would add up to three (..., f) temporaries, E C f d each
    for the experts)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weights)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up).mul_(weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weights = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        # weights: sum over the row of swiglu(x) * grad (grad_up holds swiglu(x) meanwhile)
        torch.ops.aten.silu.out(gate, out=grad_up).mul_(up)
        grad_weights = torch.matmul(grad_up.unsqueeze(-2), grad.unsqueeze(-1)).squeeze(-1)
        # up: grad * weights * silu(gate)
        torch.ops.aten.silu.out(gate, out=grad_up).mul_(grad).mul_(weights)
        # gate: grad * weights * up * silu'(gate)
        torch.mul(grad, weights, out=grad_gate).mul_(up)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_x, grad_weights.to(weights.dtype)


def weighted_activation(kind: str) -> WeightedActivation:
    """Megatron-core's expert activation with the routing weights multiplied in (module
    docstring): the fused weighted SwiGLU, or GeLU/ReLU followed by ``* weights`` (which saves
    the activation's output and the weights, as ``MLP.forward`` does unfused)."""
    if kind == "swiglu":
        return _WeightedSwiGLU.apply
    activation = F.relu if kind == "relu" else F.gelu
    return lambda x, weights: (activation(x) * weights).to(x.dtype)


class Router(nn.Module):
    """Megatron-core's ``TopKRouter``: logits = x W^T (W: (E, h), no bias), then ``route``."""

    def __init__(self, *, hidden: int, num_experts: int, top_k: int, pre_softmax: bool):
        super().__init__()
        self.top_k = top_k
        self.pre_softmax = pre_softmax
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, h) -> (weights, indices), each (T, k)."""
        return route(F.linear(x, self.weight), top_k=self.top_k, pre_softmax=self.pre_softmax)


class Experts(nn.Module):
    """E routed experts as stacked weights (Megatron's ``GroupedMLP``), called as transformers'
    experts modules are: ``forward(hidden (T, h), top_k_index (T, k), top_k_weights (T, k))``."""

    def __init__(
        self,
        *,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        kind: str,
        bias: bool,
        capacity_factor: float,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.kind = kind
        width = 2 * ffn_hidden if kind == "swiglu" else ffn_hidden
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, width)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        for weight in (self.fc1_weight, self.fc2_weight):  # nn.Linear's default, per expert
            bound = 1.0 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return capacity_experts_forward(
            hidden,
            top_k_index,
            top_k_weights,
            fc1_weight=self.fc1_weight,
            fc2_weight=self.fc2_weight,
            fc1_bias=self.fc1_bias,
            fc2_bias=self.fc2_bias,
            weighted_activation=weighted_activation(self.kind),
            capacity_factor=self.capacity_factor,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, capacity_factor={self.capacity_factor}"


class MoE(nn.Module):
    """router -> routed experts (+ shared experts) -> dropout: (b, s, h) -> (b, s, h)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.router = Router(
            hidden=config.hidden,
            num_experts=config.num_experts,
            top_k=config.top_k,
            pre_softmax=config.router_pre_softmax,
        )
        self.experts = Experts(
            hidden=config.hidden,
            ffn_hidden=config.expert_ffn_width,
            num_experts=config.num_experts,
            kind=config.mlp,
            bias=config.bias,
            capacity_factor=config.capacity_factor,
        )
        self.shared_experts = (
            MLP(
                hidden=config.hidden,
                ffn_hidden=config.shared_experts * config.expert_ffn_width,
                kind=config.mlp,
                bias=config.bias,
            )
            if config.shared_experts
            else None
        )
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, indices = self.router(tokens)
        out = self.experts(tokens, indices, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return self.dropout(out.view(x.shape))
