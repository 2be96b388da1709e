"""Default layer granularity for any nn.Module: its repeated blocks plus the parts around them.

Rule: the blocks are the children of the ``nn.ModuleList`` (or ``nn.Sequential``) that holds the
most parameters (ties: the longest list). A model without such a list gets its top-level children
(containers expanded). Every module on the path from the root to that list
contributes its other children that own parameters (embeddings before the blocks, final norm and
head after them), in registration order, which is the execution order for the usual
embedding -> blocks -> head models. Encoder-decoder models have two block lists; the rule is then
applied to each sub-tree that holds one (e.g. ``encoder`` and ``decoder`` of a T5).

Roles (the graph's ``kind``, :func:`layer_kinds`): a layer that is, or lies inside, a member of
the block list(s) this rule picks is a ``block``; in execution order the layers before the first
block are ``embedding``, those after the last block ``head`` (the final norm too: Megatron builds
it with the output layer, in the last stage's post-process), and a layer between two blocks that
is not itself a block (an encoder's final norm and a decoder's embedding in an encoder-decoder
model) is ``other``.
"""

from __future__ import annotations

from torch import nn


def default_layer_paths(module: nn.Module) -> list[str]:
    """Module paths of the default layers, in registration order. A module registered under two
    paths (a tied embedding, e.g. T5's ``shared`` and ``encoder.embed_tokens``) is listed once."""
    paths = _split(module, prefix="") or _children(module, "")
    seen, unique = set(), []
    for path in paths:
        target = module.get_submodule(path)
        if id(target) not in seen:
            seen.add(id(target))
            unique.append(path)
    return unique


def block_list_paths(module: nn.Module) -> list[str]:
    """Paths of the block list(s) the default rule picks: the largest list, or one per stack of
    an encoder-decoder model ([] when the model has no list of parameterised modules)."""
    lists: list[str] = []
    _split(module, prefix="", lists=lists)
    return lists


def block_paths(module: nn.Module, paths: list[str]) -> set[str]:
    """The paths that are, or lie inside, a member of one of :func:`block_list_paths`'s lists
    (``model.layers.3``, or ``model.layers.3.mlp`` for a finer selection)."""
    lists = block_list_paths(module)
    found = set()
    for path in paths:
        for list_path in lists:
            prefix = f"{list_path}." if list_path else ""
            if path.startswith(prefix) and path != list_path:
                found.add(path)
                break
    return found


def layer_kinds(names: list[str], blocks: set[str]) -> list[str] | None:
    """Each layer's kind, ``names`` in execution order: ``block`` for ``blocks``, ``embedding``
    before the first block, ``head`` after the last one, ``other`` in between; None when there is
    no block (the graph format's name rule decides)."""
    where = [i for i, name in enumerate(names) if name in blocks]
    if not where:
        return None
    first, last = where[0], where[-1]
    return [
        "block" if name in blocks else "embedding" if i < first else "head" if i > last else "other"
        for i, name in enumerate(names)
    ]


def _children(module: nn.Module, prefix: str) -> list[str]:
    """Top-level children, with ModuleList/ModuleDict/Sequential expanded into their members."""
    paths = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            paths.extend(_children(child, f"{prefix}{name}."))
        else:
            paths.append(f"{prefix}{name}")
    return paths


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _block_lists(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """(path, list) of every ModuleList/Sequential with parameterised children below module."""
    found = []
    for name, child in module.named_modules(prefix=prefix.rstrip(".")):
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            members = [c for c in child.children() if _owns_parameters(c)]
            if members:
                found.append((name, child))
    return found


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _split(module: nn.Module, prefix: str, lists: list[str] | None = None) -> list[str]:
    """Layers below ``module`` (whose path is ``prefix``); the paths of the block lists it picks
    are appended to ``lists``."""
    lists = [] if lists is None else lists
    if isinstance(module, (nn.ModuleList, nn.Sequential)):  # a stack: its members are the blocks
        lists.append(prefix.rstrip("."))
        return [
            f"{prefix}{name}" for name, block in module.named_children() if _owns_parameters(block)
        ]
    found = _block_lists(module, prefix)
    if not found:
        return []
    path, blocks = max(found, key=lambda item: (_size(item[1]), len(item[1])))
    # children of a module that contains two disjoint block lists (encoder + decoder) are split
    # separately, so that both stacks become blocks
    if _has_parallel_stacks(module, prefix):
        layers = []
        for name, child in module.named_children():
            child_path = f"{prefix}{name}"
            inner = _split(child, f"{child_path}.", lists)
            if inner:
                layers.extend(inner)
            elif _owns_parameters(child):
                layers.append(child_path)
        return layers
    layers = []
    lists.append(path)
    _collect(module, prefix, path, layers)
    return layers


def _has_parallel_stacks(module: nn.Module, prefix: str) -> bool:
    """True when two different direct children of ``module`` each hold a block list."""
    holders = set()
    for name, child in module.named_children():
        if _block_lists(child, f"{prefix}{name}."):
            holders.add(name)
    return len(holders) >= 2


def _collect(module: nn.Module, prefix: str, target: str, layers: list[str]) -> None:
    """Walk from ``module`` towards the block list at ``target``, keeping the siblings."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path == target:
            layers.extend(
                f"{path}.{i}" for i, block in enumerate(child.children()) if _owns_parameters(block)
            )
        elif target.startswith(f"{path}."):
            _collect(child, f"{path}.", target, layers)
        elif _owns_parameters(child):
            layers.append(path)
