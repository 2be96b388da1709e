"""The torch runtime's recomputation (non-reentrant ``torch.utils.checkpoint`` of each layer's
module) in the cost model: a checkpointed layer keeps the inputs it charges and its glue's
saved tensors, re-materialises the rest, and runs beside its output's gradient except at the
model's last layer (``solver.costs.layers.checkpointed_layer_bytes``); the megatron runtime
keeps the block rule (the output)."""

from __future__ import annotations

import json

import pytest

from solver.cli import plan_main
from solver.costs import layer_costs
from solver.graph import load_graph
from solver.specs import Cluster, ParallelConfig, TrainingConfig

H, V, CS = 1000, 8000, 100
"""Per-sample bytes: a hidden state, the logits, a rotary table (an extra input of the blocks)."""


def _graph(**meta) -> dict:
    """embed -> 2 blocks (each reads the rotary table embed makes) -> head with a loss's glue."""
    layer = {"params": 10, "largest_param": 10, "transient_bytes": 50, "output_bytes": H,
             "weight_grad_transient_bytes": 0}  # fmt: skip
    layers = [
        {**layer, "name": "embed", "kind": "embedding", "activation_bytes": 8},
        {**layer, "name": "b0", "kind": "block", "activation_bytes": 5000},
        {**layer, "name": "b1", "kind": "block", "activation_bytes": 4000},
        {**layer, "name": "head", "kind": "head", "activation_bytes": H + 9000,
         "output_bytes": V, "transient_bytes": 2 * V},
    ]  # fmt: skip
    chain = {"saved": True, "charged": True}
    edges = [
        {"src": "embed", "dst": "b0", "bytes": H, "tensor": "embed:0", **chain},
        {"src": "embed", "dst": "b0", "bytes": CS, "tensor": "embed:1", **chain},
        {"src": "embed", "dst": "b1", "bytes": CS, "tensor": "embed:1", "saved": True},
        {"src": "b0", "dst": "b1", "bytes": H, **chain},
        {"src": "b1", "dst": "head", "bytes": H, **chain},
    ]
    meta = {"glue_activation_bytes": {"head": 9000}, "unsaved_output_bytes": V, **meta}
    return {"format": "layer-graph", "version": 1, "model": "m", "meta": meta,
            "layers": layers, "edges": edges}  # fmt: skip


def _costs(runtime: str, document: dict | None = None):
    config = ParallelConfig(pp=1, tp=1, dp=1, micro_batch=2, num_microbatches=2,
                            recompute="full")  # fmt: skip
    training = TrainingConfig(global_batch=4, runtime=runtime)
    graph = load_graph(document or _graph())
    return layer_costs(graph, config, Cluster(num_gpus=1), training)


def test_a_checkpointed_layer_keeps_its_charged_inputs_and_its_glue():
    costs = _costs("torch")
    b = 2
    # embed keeps the model's inputs (its saved bytes), b0 its input and the rotary table, b1
    # its input (the table is b0's), the head its input, the loss's log-softmax and the logits
    # the pipeline's loss_fn keeps
    assert costs.stored_bytes.tolist() == [b * 8, b * (H + CS), b * H, b * (H + 9000 + V)]
    remade = [0, b * (5000 - H - CS), b * (4000 - H), 0]
    grads = [b * H, b * H, b * H, 0]  # the head's output gradient is the loss's: in its T
    assert costs.transient_bytes.tolist() == [
        b * 50 + r + g for r, g in zip(remade[:3], grads[:3], strict=True)
    ] + [b * 2 * V]
    assert costs.recompute_stored_bytes.tolist() == costs.stored_bytes.tolist()


def test_the_megatron_runtime_keeps_the_block_rule():
    costs = _costs("megatron")
    b = 2
    # megatron recomputes the blocks only, each keeping its output and re-materialising all of
    # its saved bytes beside its output's gradient
    assert costs.stored_bytes.tolist()[1:3] == [b * H, b * H]
    assert costs.transient_bytes.tolist()[1:3] == [b * (50 + 5000 + H), b * (50 + 4000 + H)]


def test_a_graph_without_saving_facts_keeps_the_output_rule():
    document = _graph()
    for edge in document["edges"]:
        edge.pop("saved", None), edge.pop("charged", None)
    costs = _costs("torch", document)
    b = 2
    assert costs.stored_bytes.tolist() == [b * H, b * H, b * H, b * V + b * V]


@pytest.mark.parametrize(
    ("glue", "message"),
    [
        (
            {"nohead": 5},
            "'nohead' is not a layer of the graph; name a layer or remove the entry",
        ),
        (
            {"head": -1},
            "-1 is less than the minimum of 0",
        ),
    ],
)
def test_a_bad_glue_field_is_one_line_and_exit_2(run_cli, tmp_path, glue, message):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(_graph(glue_activation_bytes=glue)))
    out = tmp_path / "p.json"
    code, stdout, err = run_cli(
        plan_main, str(path), "--gpus", "1", "--global-batch", "4", "--runtime", "torch",
        "--recompute", "full", "--json", str(out),
    )  # fmt: skip
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "glue_activation_bytes" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]
