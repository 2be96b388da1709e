"""Write the bundled example layer graphs in examples/ from closed-form formulas (no torch).

    python scripts/make_examples.py [--out examples]

Every figure is PER SAMPLE (one sequence, one image) with 16-bit (bf16) activations; parameter
counts are per layer. Notation: s sequence length, h hidden size, a attention heads, V vocabulary.

Transformer block (GPT: LayerNorm, biased linears, 4h MLP, dropout), following Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", section 4:

  params        12h^2 + 13h: QKV 3h^2+3h, attention output h^2+h, MLP 4h^2+4h and 4h^2+h,
                two LayerNorms 2 x 2h; largest tensors: fc1 / fc2 4h^2 (split), h (replicated)
  tp_params     12h^2 + 7h: the four weight matrices and the column-parallel biases (QKV 3h, fc1 4h)
                are split over TP ranks; row-parallel biases (2h) and LayerNorms (4h) are replicated
  activation    34sh + 5as^2 bytes: attention 11sh + 5as^2 (QKV input 2sh, Q and K 4sh, softmax
                output 2as^2, its dropout mask as^2, dropout output 2as^2, V 2sh, projection input
                2sh, dropout mask sh), MLP 19sh (fc1 input 2sh, GeLU input 8sh, fc2 input 8sh,
                dropout mask sh), LayerNorm inputs 4sh
  tp_activation 24sh + 5as^2: with TP t the paper's per-layer total is sh(10 + 24/t + 5as/(ht)),
                i.e. 10sh replicated (QKV and fc1 inputs, the two sh dropout masks, LayerNorms)
  tp_comm       8sh: four all-reduces of the 2sh hidden state (two forward, after attention and
                after the MLP; two backward, on the attention and MLP inputs)
  output        2sh
  fwd_flops     24sh^2 + 4s^2h: linears 2 x 12h^2 per token, scores QK^T 2s^2h, values 2s^2h
                (backward defaults to 2 x forward)

Embedding (token + learned position table, vocabulary-parallel under TP):
  params Vh + sh, tp_params Vh; activation sh + 8s: the embedding-dropout mask (one byte per
  element; Korthikanti section 4.3 counts sbh for it) and the int64 token ids that the weight
  gradient indexes with; the lookup itself saves nothing large. tp_comm 2sh (the forward all-reduce
  of the vocabulary-parallel lookup); output 2sh; fwd_flops sh (adding the position embedding).

Head (final LayerNorm + untied LM head + cross-entropy loss):
  params hV + 2h, tp_params hV (vocabulary-parallel output layer)
  activation 4sh + 2sV: LayerNorm input 2sh, LM-head input (the LayerNorm output, needed for the
  weight gradient) 2sh, and the bf16 logits saved by the loss 2sV; tp_activation 2sV (logits are
  split by vocabulary); transient 8sV: the fp32 upcast of the logits (4sV) and its fp32 gradient
  (4sV) exist together in the loss backward; tp_comm 2sh + 12s (backward all-reduce of the LM-head
  input gradient, plus three fp32 per-token all-reduces of the vocab-parallel cross-entropy);
  output 4 bytes (the per-sample loss); fwd_flops 2shV.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import harness
from harness import ROOT

from solver.graph import LayerGraph, graph_from_dict

PROFILED_BY = "scripts/make_examples.py (closed form)"
BF16 = 2  # bytes per activation element


def gpt_block(name: str, *, s: int, h: int, a: int) -> dict[str, Any]:
    """One GPT transformer block (formulas in the module docstring)."""
    return {
        "name": name,
        "kind": "block",
        "params": 12 * h * h + 13 * h,
        "tp_params": 12 * h * h + 7 * h,
        "activation_bytes": 34 * s * h + 5 * a * s * s,
        "tp_activation_bytes": 24 * s * h + 5 * a * s * s,
        "output_bytes": BF16 * s * h,
        "fwd_flops": 24 * s * h * h + 4 * s * s * h,
        "tp_comm_bytes": 8 * s * h,
        "largest_param": h,  # a LayerNorm weight or a row-parallel bias
        "largest_tp_param": 4 * h * h,  # fc1 / fc2
    }


def embedding(name: str, *, s: int, h: int, vocab: int, positions: bool) -> dict[str, Any]:
    """Token embedding (+ learned positions when ``positions``), vocabulary-parallel."""
    return {
        "name": name,
        "kind": "embedding",
        "params": vocab * h + (s * h if positions else 0),
        "tp_params": vocab * h,
        "activation_bytes": s * h + 8 * s,
        "output_bytes": BF16 * s * h,
        "fwd_flops": s * h if positions else 0,
        "tp_comm_bytes": BF16 * s * h,
        "largest_param": s * h if positions else 0,
        "largest_tp_param": vocab * h,
    }


def lm_head(name: str, *, s: int, h: int, vocab: int) -> dict[str, Any]:
    """Final LayerNorm + untied LM head + cross-entropy loss."""
    return {
        "name": name,
        "kind": "head",
        "params": h * vocab + 2 * h,
        "tp_params": h * vocab,
        "activation_bytes": 4 * s * h + BF16 * s * vocab,
        "tp_activation_bytes": BF16 * s * vocab,
        "output_bytes": 4,
        "fwd_flops": 2 * s * h * vocab,
        "tp_comm_bytes": BF16 * s * h + 12 * s,
        "transient_bytes": 8 * s * vocab,
        "largest_param": h,
        "largest_tp_param": h * vocab,
    }


def gpt(model: str, *, layers: int, s: int, h: int, a: int, vocab: int) -> LayerGraph:
    """A GPT chain: embedding, ``layers`` blocks, head (no edges key: a chain)."""
    items = [embedding("embed", s=s, h=h, vocab=vocab, positions=True)]
    items += [gpt_block(f"layers.{i}", s=s, h=h, a=a) for i in range(layers)]
    items.append(lm_head("head", s=s, h=h, vocab=vocab))
    meta = {
        "seq_len": s,
        "hidden": h,
        "heads": a,
        "vocab": vocab,
        "dtype": "bf16",
        "profiled_by": PROFILED_BY,
    }
    return _graph(model, items, meta=meta)


def t5_decoder_block(name: str, *, s: int, h: int, a: int) -> dict[str, Any]:
    """A decoder block: a GPT block plus cross-attention over the encoder output.

    Encoder and decoder lengths are both s. Cross-attention adds the terms of a self-attention
    sublayer with its LayerNorm: params 4h^2 (Q, K, V, output) + 4h biases + 2h LayerNorm;
    activations 13sh + 5as^2 (Korthikanti's 11sh + 5as^2 + a 2sh LayerNorm input), where the 2sh
    "QKV input" is now only the Q input: the K/V input is the encoder output, one tensor shared by
    every decoder block and counted on its edges, not per block. TP splits Q, K, V and the output
    projection like self-attention (8sh + 5as^2 split, 5sh replicated); TP traffic adds one forward
    all-reduce (output) and two backward (Q input and encoder-output gradients): 6sh.
    FLOPs: projections 8sh^2, scores and values 4s^2h.
    """
    layer = gpt_block(name, s=s, h=h, a=a)
    layer["params"] += 4 * h * h + 4 * h + 2 * h
    layer["tp_params"] += 4 * h * h + 3 * h  # column-parallel Q, K, V biases
    layer["activation_bytes"] += 13 * s * h + 5 * a * s * s
    layer["tp_activation_bytes"] += 8 * s * h + 5 * a * s * s
    layer["fwd_flops"] += 8 * s * h * h + 4 * s * s * h
    layer["tp_comm_bytes"] += 6 * s * h
    return layer


def t5_dag(*, blocks: int, s: int, h: int, a: int, vocab: int) -> LayerGraph:
    """T5-style encoder-decoder: the encoder output feeds every decoder block (cross-attention).

    GPT-style sublayers (biases, LayerNorm) are kept for one set of formulas; real T5 drops the
    biases, uses RMSNorm and a relative position bias (32 x heads parameters per stack), which
    changes the counts by O(h). Embeddings carry no position table.
    """
    out = BF16 * s * h
    items = [embedding("enc_embed", s=s, h=h, vocab=vocab, positions=False)]
    items += [gpt_block(f"encoder.{i}", s=s, h=h, a=a) for i in range(blocks)]
    # Final encoder LayerNorm: 2h params, saves its 2sh input; ~8 FLOPs per element.
    items.append(
        {
            "name": "enc_final_norm",
            "kind": "other",
            "params": 2 * h,
            "activation_bytes": out,
            "output_bytes": out,
            "fwd_flops": 8 * s * h,
            "largest_param": h,
        }
    )
    items.append(embedding("dec_embed", s=s, h=h, vocab=vocab, positions=False))
    items += [t5_decoder_block(f"decoder.{i}", s=s, h=h, a=a) for i in range(blocks)]
    items.append(lm_head("head", s=s, h=h, vocab=vocab))

    chain = ["enc_embed", *[f"encoder.{i}" for i in range(blocks)], "enc_final_norm"]
    decoder = ["dec_embed", *[f"decoder.{i}" for i in range(blocks)], "head"]
    edges = [(u, v) for path in (chain, decoder) for u, v in pairwise(path)]
    edges += [("enc_final_norm", f"decoder.{i}") for i in range(blocks)]
    meta = {
        "seq_len": s,
        "hidden": h,
        "heads": a,
        "vocab": vocab,
        "dtype": "bf16",
        "profiled_by": PROFILED_BY,
        "encoder_layers": blocks,
        "decoder_layers": blocks,
    }
    return _graph("t5-style-6+6 (closed form)", items, edges=edges, meta=meta)


def conv_units(units: list[tuple[int, int, int, int, int, bool]]) -> dict[str, int]:
    """Sum of conv + BatchNorm (+ ReLU) units (r_in, r_out, c_in, c_out, kernel, relu).

    Per unit: params k^2 c_in c_out + 2 c_out (no conv bias; BN scale and shift); saved bytes
    2 r_in^2 c_in (conv input) + 2 r_out^2 c_out (BN input) + 2 r_out^2 c_out if ReLU (its
    output); forward FLOPs 2 k^2 c_in c_out r_out^2. r is the side of the square feature map.
    """
    total = {"params": 0, "activation_bytes": 0, "fwd_flops": 0, "largest_param": 0}
    for r_in, r_out, c_in, c_out, k, relu in units:
        total["params"] += k * k * c_in * c_out + 2 * c_out
        total["largest_param"] = max(total["largest_param"], k * k * c_in * c_out)
        total["activation_bytes"] += BF16 * (
            r_in * r_in * c_in + r_out * r_out * c_out * (2 if relu else 1)
        )
        total["fwd_flops"] += 2 * k * k * c_in * c_out * r_out * r_out
    return total


def resnet_skip_dag(*, image: int = 224, classes: int = 21843) -> LayerGraph:
    """ResNet-50-shaped CNN (bottleneck v1.5, stride on the 3x3) with two kinds of DAG edges.

    Branch: the first block of every stage is split into its main path, its projection shortcut
    (1x1 conv + BN) and the residual add + ReLU, so the block input fans out to two layers that
    join again. Long skip: the conv3 output (28x28x512) also feeds the head, which pools it with
    the conv5 output (multi-scale head), so a stage split carries it past the stages in between.
    Early layers are activation-heavy (56x56 maps), late ones parameter-heavy (2048 channels and a
    2560 x 21843 ImageNet-21k classifier). A tensor read by two layers (a projection block's input)
    is counted by each, as a per-layer profile would. Layers have no tensor parallelism.
    """
    items: list[dict[str, Any]] = []
    edges: list[tuple[str, str]] = []

    def add(layer: dict[str, Any], *sources: str) -> str:
        items.append(layer)
        edges.extend((src, layer["name"]) for src in sources)
        return layer["name"]

    # Stem: 7x7/2 conv 3->64 (224 -> 112), BN, ReLU, 3x3/2 max-pool (-> 56) saving int64 indices.
    r = image // 4
    stem = conv_units([(image, image // 2, 3, 64, 7, True)])
    stem["activation_bytes"] += 8 * r * r * 64
    previous = add({"name": "stem", "kind": "other", **stem, "output_bytes": BF16 * r * r * 64})
    channels = 64
    long_skip = ""
    for stage, (num_blocks, mid, stride) in enumerate(
        [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)], start=1
    ):
        r_in, r = r, r // stride
        previous = _resnet_stage(add, previous, stage, num_blocks, mid, stride, r_in, channels)
        channels = 4 * mid
        if stage == 2:
            long_skip = previous
    # Head: average-pool conv5 (7x7x2048) and conv3 (28x28x512) to 2560 features, FC to the
    # classes, softmax cross-entropy. Saves the pooled features and the fp32 logits.
    features = channels + 512
    add(
        {
            "name": "head",
            "kind": "head",
            "params": features * classes + classes,
            "largest_param": features * classes,
            "activation_bytes": BF16 * features + 4 * classes,
            "output_bytes": 4,
            "fwd_flops": r * r * channels + 28 * 28 * 512 + 2 * features * classes,
        },
        previous,
        long_skip,
    )
    meta = {
        "image_size": image,
        "num_classes": classes,
        "dtype": "bf16",
        "profiled_by": PROFILED_BY,
    }
    return _graph("resnet50-skip (closed form)", items, edges=edges, meta=meta)


def _resnet_stage(
    add: Callable[..., str],
    previous: str,
    stage: int,
    num_blocks: int,
    mid: int,
    stride: int,
    r_in: int,
    channels: int,
) -> str:
    """One ResNet stage of ``num_blocks`` bottleneck blocks (width ``mid``, output 4 ``mid``
    channels, the first block striding from side ``r_in``), each added after ``previous`` by
    ``add``; the name of the stage's last layer. The first block is split into its main path,
    its projection shortcut and the residual add (see :func:`resnet_skip_dag`)."""
    r = r_in // stride
    out_channels = 4 * mid
    out_bytes = BF16 * r * r * out_channels
    for b in range(num_blocks):
        c_in, r_block = (channels, r_in) if b == 0 else (out_channels, r)
        s_ = stride if b == 0 else 1
        main = conv_units(
            [
                (r_block, r_block, c_in, mid, 1, True),
                (r_block, r_block // s_, mid, mid, 3, True),
                (r, r, mid, out_channels, 1, False),
            ]
        )
        name = f"conv{stage + 1}.{b}"
        if b == 0:
            main_name = add(
                {"name": f"{name}.main", "kind": "block", **main, "output_bytes": out_bytes},
                previous,
            )
            proj = conv_units([(r_block, r, c_in, out_channels, 1, False)])
            proj_name = add(
                {"name": f"{name}.proj", "kind": "other", **proj, "output_bytes": out_bytes},
                previous,
            )
            # Residual add + ReLU: saves the ReLU output; 2 FLOPs per element.
            previous = add(
                {
                    "name": f"{name}.add",
                    "kind": "other",
                    "params": 0,
                    "activation_bytes": out_bytes,
                    "output_bytes": out_bytes,
                    "fwd_flops": 2 * r * r * out_channels,
                },
                main_name,
                proj_name,
            )
        else:
            # Identity shortcut inside the layer: add + ReLU saves one more map.
            main["activation_bytes"] += out_bytes
            main["fwd_flops"] += 2 * r * r * out_channels
            previous = add(
                {"name": name, "kind": "block", **main, "output_bytes": out_bytes}, previous
            )
    return previous


def _graph(
    model: str,
    layers: list[dict[str, Any]],
    *,
    meta: dict[str, Any],
    edges: list[tuple[str, str]] | None = None,
) -> LayerGraph:
    """Validate through the loader; an edge carries its source layer's output_bytes."""
    document: dict[str, Any] = {
        "format": "layer-graph",
        "version": 1,
        "model": model,
        "meta": meta,
        "layers": layers,
    }
    if edges is not None:
        output = {layer["name"]: layer["output_bytes"] for layer in layers}
        document["edges"] = [{"src": u, "dst": v, "bytes": output[u]} for u, v in edges]
    return graph_from_dict(document, origin=model)


def build_examples() -> dict[str, LayerGraph]:
    """File name -> graph."""
    return {
        # GPT-3 XL shape (Brown et al. 2020, table 2.1), untied head: the quick-start default.
        "gpt-1.3b.json": gpt(
            "gpt-1.3b (GPT-3 XL shape, closed form)", layers=24, s=2048, h=2048, a=16, vocab=50257
        ),
        "gpt3-175b.json": gpt(
            "gpt3-175b (closed form)", layers=96, s=2048, h=12288, a=96, vocab=50257
        ),
        "t5-dag.json": t5_dag(blocks=6, s=512, h=768, a=12, vocab=32128),
        "resnet-skip-dag.json": resnet_skip_dag(),
    }


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__, out=ROOT / "examples").parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for filename, graph in build_examples().items():
        graph.save(args.out / filename)
        params = sum(layer.params for layer in graph.layers)
        print(
            f"{args.out / filename}: {graph.num_layers} layers, {len(graph.edges)} edges, "
            f"{params:,} parameters"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
