"""What megatron-core's linears hold beyond the profile (solver/costs/megatron_linear.py): the LM
head's input gradient, made before its weight gradient, and the reduce-scatter output with SP;
the all-gather buffer each rank keeps with SP. The torch runtime and older graphs unchanged."""

from __future__ import annotations

from solver.costs import layer_costs
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.test_vocab import FIXED, HIDDEN, lm_graph

WIDTH = 4096
"""Bytes per sample of the hidden state entering the head (and each block): [s, h]."""
SMALL_LOGITS = 1_000
"""A vocabulary part of the head's transient smaller than its input gradient."""


def head_graph(*, gathered: bool = True, fields: bool = True, vocab: int = 1000) -> dict:
    """``lm_graph(1000)`` with blocks sending [s, h] and a head whose weight-gradient moment
    holds nothing in torch's order (``weight_grad_transient_bytes`` 0) while its input gradient,
    ``FIXED``, is made right after (``fixed_transient_bytes``); ``gathered``: the linears'
    ``sp_gathered_bytes`` as the profile writes them."""
    document = lm_graph(vocab, fields=fields)
    embed, *blocks, head = document["layers"]
    embed["output_bytes"] = WIDTH
    for block in blocks:
        block["output_bytes"] = WIDTH
        block["activation_bytes"] = max(block["activation_bytes"], 2 * WIDTH)
        if gathered:
            block["sp_gathered_bytes"] = 2 * WIDTH  # qkv's and fc1's inputs
    head["transient_bytes"] = FIXED + SMALL_LOGITS
    if fields:
        head["vocab_transient_bytes"] = SMALL_LOGITS
    if gathered:
        head["sp_gathered_bytes"] = WIDTH
    return document


def costs(document: dict, *, tp: int = 1, sp: bool = False, runtime: str = "megatron"):
    config = ParallelConfig(pp=1, tp=tp, dp=1, micro_batch=2, num_microbatches=2, sp=sp)
    return layer_costs(
        graph_from_dict(document),
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=4, runtime=runtime, optimizer_impl="fused"),
    )


def test_the_heads_weight_gradient_joins_its_input_gradient_on_megatron():
    """b = 2: the head's bf16 weight-gradient temporary (1024 padded rows x h, / t) beside its
    input gradient 2 FIXED; the torch runtime, whose autograd makes the weight gradient first,
    adds the temporary to the 0 bytes of the profile's moment."""
    for tp in (1, 2):
        temporary = 2 * 1024 * HIDDEN // tp
        assert costs(head_graph(), tp=tp).transient_bytes[-1] == 2 * FIXED + temporary
    torch = costs(head_graph(), runtime="torch").transient_bytes[-1]
    assert torch == 2 * 1000 * HIDDEN  # the whole table's temporary, nothing beside it


def test_sequence_parallel_adds_the_reduce_scatter_output_and_the_gather_buffer():
    """tp 2 with SP: the head's moment + its [s/t, b, h] reduce-scatter output; every layer's
    transient + the one [s, b, h] all-gather buffer (b WIDTH: the largest single gathered input,
    not a block's two)."""
    plain = costs(head_graph(), tp=2, sp=True)
    buffer = 2 * WIDTH
    temporary = 2 * 512 * HIDDEN
    assert plain.transient_bytes[-1] == 2 * FIXED + 2 * WIDTH // 2 + temporary + buffer
    without_buffer = costs(head_graph(gathered=False), tp=2, sp=True)
    assert list(plain.transient_bytes[:-1] - without_buffer.transient_bytes[:-1]) == [buffer] * 3
    # the torch runtime keeps no such buffer: its SP saves the gathered inputs instead
    torch = costs(head_graph(), tp=2, sp=True, runtime="torch")
    assert (
        torch.transient_bytes[1]
        == costs(head_graph(gathered=False), tp=2, sp=True, runtime="torch").transient_bytes[1]
    )


def test_without_the_transients_parts_the_whole_transient_joins_the_temporary():
    """A head with ``vocab_rows`` but no fixed/vocabulary parts of its transients: its whole
    transient T beside the temporary (high, never low), or, when less, torch's weight-gradient
    moment (0 here) with the input gradient Megatron makes before it (the [s, h] entering the
    head, WIDTH < T); a graph without any vocabulary field (written before them) names no head
    and keeps the profile's moment."""
    document = head_graph()
    for key in (
        "vocab_transient_bytes",
        "fixed_transient_bytes",
        "vocab_weight_grad_transient_bytes",
        "fixed_weight_grad_transient_bytes",
    ):
        del document["layers"][-1][key]
    assert costs(document).transient_bytes[-1] == 2 * WIDTH + 2 * 1024 * HIDDEN
    older = costs(head_graph(fields=False)).transient_bytes[-1]
    assert older == 2 * 1000 * HIDDEN  # the whole table's temporary, as before


def test_the_weight_gradient_moment_bounds_the_heads_moment():
    """A head whose largest fixed transient (3 [s, h]: the final norm's backward, after the
    logits are freed) exceeds torch's weight-gradient moments (1 [s, h], no vocabulary part):
    Megatron's moment is at most that, with the input gradient ([s, h]) made before the weight
    gradient: b (WIDTH + WIDTH) beside the temporary, not b 3 WIDTH (moe-tiny's LM head,
    tagged at a last stage's peak: the temporary and the input gradient, [512, 64], live).
    1024 rows, Megatron's padding at t 1 and 2: torch's moments stand as profiled."""
    document = head_graph(vocab=1024)
    head = document["layers"][-1]
    head |= {
        "transient_bytes": WIDTH + 4,
        "weight_grad_transient_bytes": WIDTH + 4,
        "fixed_transient_bytes": 3 * WIDTH + 4,
        "vocab_transient_bytes": 0,
        "fixed_weight_grad_transient_bytes": 2 * WIDTH + 4,
        "vocab_weight_grad_transient_bytes": 0,
    }
    temporary = 2 * 1024 * HIDDEN
    assert costs(document).transient_bytes[-1] == 2 * (2 * WIDTH + 4) + temporary
    # tp 2 with SP: split over t, torch's weight-gradient moments are bounded by their fixed
    # part (2 WIDTH + 4, ``vocab``), so with the input gradient the bound is 3 WIDTH + 4, the
    # largest fixed transient's; + the [s/t, b, h] reduce-scatter output and the SP buffer
    with_sp = costs(document, tp=2, sp=True).transient_bytes[-1]
    assert with_sp == 2 * (3 * WIDTH + 4) + WIDTH + temporary // 2 + 2 * WIDTH


def test_the_embedding_has_no_input_gradient():
    """The token ids need no gradient: the embedding's moment is the profile's."""
    document = head_graph()
    document["layers"][0] |= {"transient_bytes": 0, "weight_grad_transient_bytes": 0}
    assert costs(document).transient_bytes[0] == 2 * 1024 * HIDDEN  # its temporary alone
