"""The tensors a traced pipeline sends between stages, and two fixes torch's traced frontend
(``pipe.build_stage``, torch 2.13) needs to train HF models.

Tracing HF models (``torch.distributed.pipelining.pipeline``) makes tensors the eager model
computes once, before its blocks, into boundary tensors: the attention mask (``[b, 1, s, s]``,
float in the model's dtype with eager attention), Llama's rotary ``cos`` and ``sin`` (``[b, s,
head_dim]`` each), T5's position biases; the first stage sends them, with the hidden state, to
every stage whose blocks read them (:func:`boundaries` lists them with their bytes).

1. Constant boundary tensors: the traced frontend gives every floating boundary tensor a
   gradient: a receive buffer per micro-batch for its gradient on the sender, a gradient computed
   and sent back by the receiver, and, for a tensor sent to two or more stages (the mask with
   pp >= 3), ``PipeliningMetadataError: Backward of skip connections not supported yet``. A tensor
   that depends on no parameter and on no input that needs a gradient (the mask, ``cos``/``sin``)
   has none; :class:`ConstantAwareStage` marks it so on both sides.
2. Non-contiguous boundary tensors (T5's permuted position bias): the frontend allocates receive
   buffers with the traced strides, which gloo refuses ("input tensor has to be contiguous");
   :func:`make_boundaries_contiguous` sends a contiguous copy instead.

A tensor that needs a gradient and goes to two or more stages (T5's encoder output when the
decoder's blocks span stages) cannot be trained by the traced frontend:
:func:`check_no_gradient_skips` says so before the run.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from profiling._torch_compat import modify_graph_op_device, pipeline_stage_base
from solver.errors import InputError


@dataclass(kw_only=True, frozen=True)
class Boundary:
    """One tensor a stage sends."""

    source: int
    """Sending stage."""
    index: int
    """Its index among the sending stage's outputs."""
    destinations: tuple[int, ...]
    """Receiving stages."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    """Bytes per micro-batch."""
    constant: bool
    """Depends on no parameter and no input that needs a gradient: no gradient flows back."""


def _stage_nodes(pipe) -> list[fx.Node]:
    return [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]


def _output_values(module: fx.GraphModule) -> list[fx.Node]:
    output = next(node for node in module.graph.nodes if node.op == "output")
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _source_of(arg: fx.Node, index_of: dict[str, int]) -> tuple[int, int] | None:
    """(stage, output index) of a stage argument in the pipe graph; None for a model input."""
    if arg.op == "placeholder":
        return None
    if arg.target is operator.getitem:
        return index_of[arg.args[0].name], arg.args[1]
    return index_of[arg.name], 0


def _attribute(module: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    try:
        return getattr(module.get_submodule(owner) if owner else module, name)
    except AttributeError:
        return None


def _grad_flow(module: nn.Module, grad_inputs: list[bool]) -> list[bool]:
    """For each output of ``module`` (an fx graph module, or a leaf module), whether it depends
    on a parameter or on one of the inputs flagged in ``grad_inputs``; submodule calls are
    followed into their own graphs (the traced stages nest one graph per module)."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):  # a leaf: every output depends on its parameters
        return [any(p.requires_grad for p in module.parameters()) or any(grad_inputs)]
    state: dict[fx.Node, bool | list[bool]] = {}

    def whole(value) -> bool:
        found: list[fx.Node] = []
        fx.node.map_arg(value, found.append)
        return any(any(f) if isinstance(f, list) else f for f in (state[n] for n in found))

    placeholders = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            state[node] = placeholders < len(grad_inputs) and grad_inputs[placeholders]
            placeholders += 1
        elif node.op == "get_attr":
            value = _attribute(module, str(node.target))
            state[node] = isinstance(value, torch.Tensor) and value.requires_grad
        elif node.op == "call_module":
            inputs = [whole(arg) for arg in (*node.args, *node.kwargs.values())]
            flows = _grad_flow(module.get_submodule(str(node.target)), inputs)
            state[node] = flows if len(flows) > 1 else flows[0]
        elif node.op == "call_function" and node.target is operator.getitem:
            source = state[node.args[0]]
            state[node] = source[node.args[1]] if isinstance(source, list) else source
        elif node.op == "output":
            values = node.args[0]
            values = list(values) if isinstance(values, (tuple, list)) else [values]
            return [whole(value) for value in values]
        else:
            state[node] = whole((node.args, node.kwargs))
    return [False]


def boundaries(pipe) -> list[Boundary]:
    """Every tensor a stage of ``pipe`` sends, in stage and output order."""
    stage_nodes = _stage_nodes(pipe)
    index_of = {node.name: i for i, node in enumerate(stage_nodes)}
    destinations: dict[tuple[int, int], list[int]] = {}
    for receiver, node in enumerate(stage_nodes):
        for arg in node.args:
            source = _source_of(arg, index_of)
            if source is not None:
                destinations.setdefault(source, []).append(receiver)
    constant: dict[tuple[int, int], bool] = {}
    found = []
    for stage, node in enumerate(stage_nodes):
        module = pipe.get_stage_module(stage)
        grad_inputs = []
        for arg in node.args:
            source = _source_of(arg, index_of)
            grad_inputs.append(source is not None and not constant[source])
        flows = _grad_flow(module, grad_inputs)
        for index, value in enumerate(_output_values(module)):
            example = value.meta["val"]
            is_constant = not example.is_floating_point() or not flows[index]
            constant[(stage, index)] = is_constant
            if (stage, index) in destinations:
                found.append(
                    Boundary(
                        source=stage,
                        index=index,
                        destinations=tuple(destinations[(stage, index)]),
                        shape=tuple(example.shape),
                        dtype=example.dtype,
                        nbytes=example.numel() * example.element_size(),
                        constant=is_constant,
                    )
                )
    return found


def check_no_gradient_skips(pipe, model_name: str) -> None:
    """InputError for a tensor that needs a gradient and goes to two or more stages."""
    for boundary in boundaries(pipe):
        if not boundary.constant and len(boundary.destinations) > 1:
            raise InputError(
                f"model {model_name}: the traced stage {boundary.source} sends a "
                f"{list(boundary.shape)} tensor that needs a gradient to stages "
                f"{list(boundary.destinations)}; torch.distributed.pipelining cannot train a "
                "tensor sent to two stages (its 'skip connections'), so put the layers that read "
                "it on one stage (T5: the decoder's blocks)"
            )


def make_boundaries_contiguous(pipe) -> None:
    """Send a contiguous copy of every non-contiguous boundary tensor (graph edit of the sending
    stage, and the receiving stages' input metadata)."""
    stage_nodes = _stage_nodes(pipe)
    index_of = {node.name: i for i, node in enumerate(stage_nodes)}
    fixed: set[tuple[int, int]] = set()
    for stage in range(len(stage_nodes)):
        module = pipe.get_stage_module(stage)
        output = next(node for node in module.graph.nodes if node.op == "output")
        values = _output_values(module)
        changed = False
        for index, value in enumerate(values):
            example = value.meta["val"]
            if example.is_contiguous():
                continue
            with module.graph.inserting_before(output):
                copy = module.graph.call_function(
                    torch.ops.aten.clone.default,
                    (value,),
                    {"memory_format": torch.contiguous_format},
                )
            copy.meta["val"] = _contiguous_meta(example)
            values[index] = copy
            fixed.add((stage, index))
            changed = True
        if changed:
            multiple = isinstance(output.args[0], (tuple, list))
            output.args = (tuple(values) if multiple else values[0],)
            module.recompile()
    for receiver, node in enumerate(stage_nodes):
        module = pipe.get_stage_module(receiver)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        for placeholder, arg in zip(placeholders, node.args, strict=True):
            if _source_of(arg, index_of) in fixed:
                placeholder.meta["val"] = _contiguous_meta(placeholder.meta["val"])


def _contiguous_meta(example: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``example``'s shape and dtype, contiguous (what pipelining reads)."""
    return torch.empty(example.shape, dtype=example.dtype, device="meta")


def constant_aware_stage(pipe, stage_index: int, device: torch.device, group=None):
    """``pipe.build_stage(stage_index, device, group)`` whose constant boundary tensors carry no
    gradient (:class:`ConstantAwareStage`)."""
    constants = {(b.source, b.index) for b in boundaries(pipe) if b.constant}
    stage_nodes = _stage_nodes(pipe)
    index_of = {node.name: i for i, node in enumerate(stage_nodes)}
    module = pipe.get_stage_module(stage_index)
    modify_graph_op_device(module, device)  # what build_stage does first
    constant_inputs = {
        position
        for position, arg in enumerate(stage_nodes[stage_index].args)
        if _source_of(arg, index_of) in constants
    }
    constant_outputs = {index for source, index in constants if source == stage_index}
    return ConstantAwareStage(
        module,
        stage_index,
        pipe.info(),
        device,
        group,
        constant_inputs=constant_inputs,
        constant_outputs=constant_outputs,
    )


class ConstantAwareStage(pipeline_stage_base()):
    """``_PipelineStage`` (what ``pipe.build_stage`` returns) that marks the constant inputs it
    receives and the constant outputs it sends as needing no gradient: no gradient receive
    buffers for them, no gradient sent back, and no skip-connection error."""

    def __init__(self, *args, constant_inputs: set[int], constant_outputs: set[int], **kwargs):
        self._constant_inputs = constant_inputs
        self._constant_outputs = constant_outputs
        super().__init__(*args, **kwargs)

    def _create_act_recv_info(self):
        infos = super()._create_act_recv_info()
        for position in self._constant_inputs:
            info = infos[position]
            info.tensor_meta = dataclasses.replace(info.tensor_meta, requires_grad=False)
            info.buffer.requires_grad_(False)
        return infos

    def _create_act_send_info(self):
        send_info = super()._create_act_send_info()
        self._stage_meta.outputs = tuple(
            dataclasses.replace(meta, requires_grad=False)
            if index in self._constant_outputs
            else meta
            for index, meta in enumerate(self._stage_meta.outputs)
        )
        return send_info
