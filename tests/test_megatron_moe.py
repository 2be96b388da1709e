"""Mixture of experts on the megatron engine (profiling/executors/megatron_moe.py): megatron-core's
MoELayer with expert parallelism over gloo, built from the plan's Megatron export.

The distributed runs (two ranks, dp 2 with ep 2: each rank holds 2 of the 4 experts, tokens
cross in the all-to-all) train the zoo's moe-tiny with a dense first block and a shared expert,
padded to a capacity and dropless, and their gradients equal a single-process megatron-core
run's; the single-process model has the zoo model's parameter count in every layer. The routing
is the zoo's: Megatron's own routing, capacity and permutation functions give the zoo block's
output. Bad input needs no run.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch

import models
from profiling.executors.megatron_model import megatron_settings, transformer_config
from profiling.executors.megatron_moe import moe_settings, parse_layer_freq
from profiling.export import export_graph
from profiling.run import run_plan
from solver import Cluster, TrainingConfig, plan
from solver.errors import InputError
from solver.files.plan_file import load_plan
from solver.report.plan_report import plan_to_dict

pytest.importorskip("megatron.core", reason="megatron-core is the [megatron] extra")

MOE = {
    "layers": 4,
    "dense_layers": 1,
    "shared_experts": 1,
    "expert_ffn_hidden": 48,
    "dropout": 0.0,
    "vocab_size": 256,
}
"""moe-tiny (4 experts, top-2, SwiGLU, RMSNorm, rotary) with a dense first block and one shared
expert: every kind of MoE parameter Megatron builds; 256 vocabulary rows, which Megatron does
not pad at tp <= 2 (the zoo's parameters and gradients compare exactly)."""
FP32 = dict(weight_bytes_per_param=4, grad_bytes_per_param=4, optimizer_bytes_per_param=8)


CAPACITY = 1.25
"""The routing capacity of the padded runs (Megatron's --moe-expert-capacity-factor with
--moe-pad-expert-input-to-capacity): shapes that do not depend on the routing."""


def moe_flags(config: models.gpt.GPTConfig, ep: int, capacity: float | str) -> list[str]:
    """Megatron-LM's MoE flags for the preset and ``ep`` (the export's, where the planner does
    not write them): a padded capacity, or Megatron's dropless router for "dropless"."""
    flags = [
        "--num-experts",
        str(config.num_experts),
        "--moe-router-topk",
        str(config.top_k),
        "--expert-model-parallel-size",
        str(ep),
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    if capacity != "dropless":
        flags += ["--moe-expert-capacity-factor", str(capacity)]
        flags.append("--moe-pad-expert-input-to-capacity")
    return flags


def moe_plan(
    overrides: dict,
    *,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    global_batch: int = 8,
    capacity: float | str = CAPACITY,
) -> dict:
    """A plan from the real planner for moe-tiny with pinned degrees, ``ep`` and the routing
    capacity (``TrainingConfig.ep`` and ``moe_capacity_factor``); an export without MoE flags
    (a planner without expert parallelism) gets them here."""
    expert_options = {}
    if "ep" in TrainingConfig.__dataclass_fields__:
        expert_options = dict(ep=(ep,), moe_capacity_factor=capacity)
    graph = export_graph("moe-tiny", dtype="fp32", overrides=overrides)
    training = TrainingConfig(
        global_batch=global_batch,
        micro_batch_sizes=(2,),
        zero_stages=(0,),
        runtime="megatron",
        pp=pp,
        tp=1,
        dp=dp,
        max_slowdown=None,
        **expert_options,
        **FP32,
    )
    cluster = Cluster(num_gpus=pp * dp, gpu_memory_bytes=2**30)
    document = plan_to_dict(plan(graph, cluster, training))
    args = document["exports"]["megatron"]["args"]
    if "--num-experts" not in args:
        document["config"]["ep"] = ep
        args += moe_flags(models.get("moe-tiny", **overrides).config, ep, capacity)
    return document


def layer_of(megatron_name: str) -> str:
    """The zoo layer of a megatron-core GPTModel parameter (E, t, L)."""
    match = re.match(r"decoder\.layers\.(\d+)\.", megatron_name)
    if match:
        return f"layers.{match.group(1)}"
    return "embed" if megatron_name.startswith("embedding.") else "head"


def params_per_layer(named_shapes) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for name, shape in named_shapes:
        counts[name] += shape.numel()
    return dict(counts)


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_run_has_the_single_process_gradients_and_the_zoo_parameters():
    reference = moe_plan(MOE, global_batch=8)
    (single,) = run_plan(
        "moe-tiny", reference, overrides=MOE, engine="megatron", capture_grads=True
    )
    # the same parameters per layer as the zoo's model (router, experts, shared expert, norms)
    spec = models.get("moe-tiny", **MOE)
    with torch.device("meta"):
        zoo = spec.build()
    zoo_counts = params_per_layer(
        (
            name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2]),
            param.shape,
        )
        for name, param in zoo.named_parameters()
    )
    megatron_counts = params_per_layer((layer_of(n), g.shape) for n, g in single.grads.items())
    assert megatron_counts == zoo_counts

    expert_parallel = moe_plan(MOE, dp=2, ep=2, global_batch=8)
    assert load_plan(expert_parallel).config.ep == 2
    reports = run_plan(
        "moe-tiny", expert_parallel, overrides=MOE, engine="megatron", capture_grads=True
    )
    got: dict[str, torch.Tensor] = {}
    for report in reports:
        experts = {
            int(m.group(1))
            for name in report.grads
            if (m := re.match(r"decoder\.layers\.1\.mlp\.experts\.local_experts\.(\d+)\.", name))
        }
        assert experts == {2 * report.dp_rank, 2 * report.dp_rank + 1}  # E/ep = 2 per rank
        for name, grad in report.grads.items():
            if name in got:  # dense parameters: replicas over dp hold the same gradient
                torch.testing.assert_close(grad, got[name], atol=1e-5, rtol=1e-4)
            got[name] = grad
    assert sorted(got) == sorted(single.grads)
    for name, grad in single.grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # each rank holds 2 of the 4 experts of the 3 MoE blocks: 2 x 3 x (3 h f) fp32 weights less
    expert_bytes = 3 * 32 * 48 * 4
    for report in reports:
        saved = single.measured_breakdown["params"] - report.measured_breakdown["params"]
        assert saved == 3 * 2 * expert_bytes


@pytest.mark.slow
@pytest.mark.distributed
def test_dropless_expert_parallel_run_has_the_single_process_gradients():
    """Without a capacity Megatron's router is dropless: the all-to-all's splits come from the
    routing (bypass 9 of profiling/executors/megatron_cpu.py hands them over as host numbers), and
    the ep 2 run still trains the single-process model."""
    single_plan = moe_plan(MOE, capacity="dropless")
    (single,) = run_plan(
        "moe-tiny", single_plan, overrides=MOE, engine="megatron", capture_grads=True
    )
    dropless = moe_plan(MOE, dp=2, ep=2, capacity="dropless")
    assert "--moe-expert-capacity-factor" not in dropless["exports"]["megatron"]["args"]
    reports = run_plan("moe-tiny", dropless, overrides=MOE, engine="megatron", capture_grads=True)
    got = {name: grad for report in reports for name, grad in report.grads.items()}
    assert sorted(got) == sorted(single.grads)
    for name, grad in single.grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-4, msg=name)


# -- the zoo's routing, with megatron-core's functions ----------------------------------------


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_megatron_routing_and_padded_dispatch_give_the_zoo_blocks_output(pre_softmax):
    """megatron-core's top-k routing, capacity dropping (policy probs, padded), drop-and-pad
    permutation, per-token scaling inside the expert and unpermutation, as its all-to-all
    dispatcher chains them, equal ``models.moe``'s routed experts, with tokens dropped."""
    from megatron.core.transformer.moe import moe_utils

    from models.moe import capacity_experts_forward, route, weighted_activation

    tokens, hidden, ffn, num_experts, top_k, factor = 16, 8, 6, 4, 2, 1.0
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    logits = torch.randn(tokens, num_experts, generator=generator, dtype=torch.float64)
    logits[:, 0] += 2.0  # expert 0 over its capacity: tokens are dropped
    fc1 = torch.randn(num_experts, 2 * ffn, hidden, generator=generator, dtype=torch.float64)
    fc2 = torch.randn(num_experts, hidden, ffn, generator=generator, dtype=torch.float64)

    weights, indices = route(logits, top_k=top_k, pre_softmax=pre_softmax)
    zoo = capacity_experts_forward(
        x,
        indices,
        weights,
        fc1_weight=fc1.transpose(1, 2),  # the zoo's (GroupedMLP's) (E, in, out) layout
        fc2_weight=fc2.transpose(1, 2),
        weighted_activation=weighted_activation("swiglu"),
        capacity_factor=factor,
    )

    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, top_k, use_pre_softmax=pre_softmax
    )
    probs, routing_map = moe_utils.apply_router_token_dropping(
        probs, routing_map, router_topk=top_k, capacity_factor=factor, pad_to_capacity=True
    )
    capacity = moe_utils.get_capacity(tokens * top_k, num_experts, factor)
    assert capacity == 8 and int(routing_map.sum()) == capacity * num_experts
    permuted, permuted_probs, order = moe_utils.permute(
        x, routing_map, probs=probs, num_out_tokens=capacity * num_experts, drop_and_pad=True
    )
    outputs = []
    for expert in range(num_experts):  # megatron.core.transformer.mlp.MLP(per_token_scale=...)
        rows = slice(expert * capacity, (expert + 1) * capacity)
        gate, up = (permuted[rows] @ fc1[expert].T).chunk(2, dim=-1)
        scaled = torch.nn.functional.silu(gate) * up * permuted_probs[rows].unsqueeze(-1)
        outputs.append(scaled @ fc2[expert].T)
    megatron = moe_utils.unpermute(
        torch.cat(outputs),
        order,
        restore_shape=x.shape,
        routing_map=routing_map,
        drop_and_pad=True,
    )
    dropped = int((weights > 0).sum()) - int((probs > 0).sum())
    assert dropped > 0
    torch.testing.assert_close(megatron, zoo)


# -- reading the export -----------------------------------------------------------------------


def test_moe_flags_are_read_as_megatron_lm_reads_them():
    args = {
        "--num-layers": "4",
        "--num-experts": "8",
        "--expert-model-parallel-size": "4",
        "--moe-expert-capacity-factor": "1.25",
        "--moe-pad-expert-input-to-capacity": None,
        "--moe-layer-freq": "([0]*1+[1]*3)",
    }
    moe = moe_settings(args)
    assert (moe.num_experts, moe.router_topk, moe.expert_parallel) == (8, 2, 4)  # top-k default 2
    assert (moe.capacity_factor, moe.pad_to_capacity) == (1.25, True)
    assert moe.router_pre_softmax is None and moe.ffn_hidden is None  # the model's
    assert moe.layer_freq == [0, 1, 1, 1] and moe.aux_loss_coeff == 0.0
    assert moe_settings({"--num-layers": "4"}) is None
    assert parse_layer_freq("2", 4) == [1, 0, 1, 0]  # an integer: every 2nd block from the first
    assert parse_layer_freq("[0,1]*2", 4) == [0, 1, 0, 1]
    with pytest.raises(InputError, match="gives 3 blocks, --num-layers is 4"):
        parse_layer_freq("[0]*1+[1]*2", 4)
    with pytest.raises(InputError, match="not an integer or a list"):
        parse_layer_freq("[1]*x", 4)
    with pytest.raises(InputError, match=r"--num-experts 'eight' is not a number"):
        moe_settings({"--num-experts": "eight"})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:full scope is deprecated")
def test_the_export_becomes_megatron_cores_moe_layer():
    """The TransformerConfig megatron-core builds the MoE layers from: the all-to-all dispatcher,
    SequentialMLP experts, padded capacity, the dense first block, no auxiliary loss."""
    chosen = moe_plan(MOE, dp=2, ep=2)
    settings = megatron_settings(load_plan(chosen))
    config = transformer_config(
        models.get("moe-tiny", **MOE),
        settings,
        dtype=torch.float32,
        deallocate_pipeline_outputs=True,
    )
    assert (config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size) == (
        4,
        2,
        2,
    )
    assert (config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size) == (48, 48)
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert config.moe_token_dispatcher_type == "alltoall" and not config.moe_grouped_gemm
    assert config.moe_expert_capacity_factor == CAPACITY and config.moe_pad_expert_input_to_capacity
    assert config.moe_aux_loss_coeff == 0.0 and not config.moe_router_pre_softmax


# -- bad input, before any process starts -----------------------------------------------------


def _edited(document: dict, *, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> dict:
    """The plan with flags (and their values) removed from its Megatron export, others added;
    its config.ep is the export's --expert-model-parallel-size (1 without)."""
    args = list(document["exports"]["megatron"]["args"])
    for flag in drop:
        at = args.index(flag)
        has_value = at + 1 < len(args) and not args[at + 1].startswith("--")
        del args[at : at + (2 if has_value else 1)]
    exports = {**document["exports"], "megatron": {**document["exports"]["megatron"]}}
    exports["megatron"]["args"] = [*args, *add]
    config = {**document["config"], "ep": 1}
    final = exports["megatron"]["args"]
    if "--expert-model-parallel-size" in final:
        config["ep"] = int(final[final.index("--expert-model-parallel-size") + 1])
    return {**document, "exports": exports, "config": config}


@pytest.fixture(scope="module")
def expert_parallel_plan() -> dict:
    return moe_plan(MOE, dp=2, ep=2)


@pytest.mark.parametrize(
    ("drop", "add", "message"),
    [
        (
            ("--num-experts", "--expert-model-parallel-size"),
            (),
            "has 4 experts per MoE block and the export no --num-experts",
        ),
        (("--moe-router-topk",), ("--moe-router-topk", "1"), "--moe-router-topk gives 1, model"),
        (
            ("--moe-pad-expert-input-to-capacity",),
            (),
            f"--moe-expert-capacity-factor {CAPACITY} without --moe-pad-expert-input-to-capacity",
        ),
        (("--num-experts",), ("--num-experts", "8"), "--num-experts gives 8, model"),
    ],
)
def test_an_export_that_does_not_describe_the_moe_model_is_one_line(
    expert_parallel_plan, drop, add, message
):
    edited = _edited(expert_parallel_plan, drop=drop, add=add)
    with pytest.raises(InputError, match=re.escape(message)):
        run_plan("moe-tiny", edited, overrides=MOE, engine="megatron")


def test_the_plans_ep_must_be_the_exports(expert_parallel_plan):
    edited = {**expert_parallel_plan, "config": {**expert_parallel_plan["config"], "ep": 1}}
    with pytest.raises(InputError, match="--expert-model-parallel-size 2 and config.ep 1 differ"):
        run_plan("moe-tiny", edited, overrides=MOE, engine="megatron")


@pytest.mark.slow
def test_expert_parallel_degree_must_divide_the_experts():
    overrides = {**MOE, "num_experts": 3, "top_k": 1}
    chosen = _edited(
        moe_plan(overrides, dp=2, ep=1),
        drop=("--expert-model-parallel-size",),
        add=("--expert-model-parallel-size", "2"),
    )
    with pytest.raises(InputError, match="--expert-model-parallel-size 2 does not divide"):
        run_plan("moe-tiny", chosen, overrides=overrides, engine="megatron")


def test_the_all_to_all_exchanges_copies_the_tracker_does_not_count():
    """Bypass 12 (``megatron_cpu``): gloo drops its references to a collective's tensors on its
    own thread, late; the engine's ``all_to_all_single`` hands it copies made outside the
    tracker, so the tracked storages are the caller's alone, and the result lands in the
    caller's output in place."""
    from profiling import _torch_compat as compat
    from profiling.executors.megatron_cpu import _all_to_all_on_copies
    from profiling.trace.memory import LiveTensorTracker

    held = []

    def exchange(output, input, *args, **kwargs):
        held.append((output, input))  # what gloo's worker would keep
        with compat.disable_current_modes():  # gloo's C++, which no mode sees
            output.copy_(input).mul_(2)

    with LiveTensorTracker() as tracker:
        source = torch.arange(8.0).reshape(4, 2)
        result = torch.empty(4, 2)
        before = tracker.current_bytes
        _all_to_all_on_copies(exchange, result, source)
        assert tracker.current_bytes == before  # the copies are not counted
    private_output, private_input = held[0]
    storages = {t.untyped_storage().data_ptr() for t in (source, result)}
    assert private_output.untyped_storage().data_ptr() not in storages
    assert private_input.untyped_storage().data_ptr() not in storages
    assert torch.equal(result, 2 * torch.arange(8.0).reshape(4, 2))
