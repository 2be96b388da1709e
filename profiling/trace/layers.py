"""Default layer granularity for any nn.Module: its repeated blocks plus the parts around them.

Rule: the blocks are the children of the ``nn.ModuleList`` (or ``nn.Sequential``) that holds the
most parameters (ties: the longest list). A model without such a list gets its top-level children
(containers expanded). Every module on the path from the root to that list
contributes its other children that own parameters (embeddings before the blocks, final norm and
head after them), in registration order, which is the execution order for the usual
embedding -> blocks -> head models. Encoder-decoder models have two block lists; the rule is then
applied to each sub-tree that holds one (e.g. ``encoder`` and ``decoder`` of a T5).
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


def _split(module: nn.Module, prefix: str) -> list[str]:
    """Layers below ``module`` (whose path is ``prefix``)."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):  # a stack: its members are the blocks
        return [
            f"{prefix}{name}" for name, block in module.named_children() if _owns_parameters(block)
        ]
    lists = _block_lists(module, prefix)
    if not lists:
        return []
    path, blocks = max(lists, key=lambda item: (_size(item[1]), len(item[1])))
    # children of a module that contains two disjoint block lists (encoder + decoder) are split
    # separately, so that both stacks become blocks
    if _has_parallel_stacks(module, prefix):
        layers = []
        for name, child in module.named_children():
            child_path = f"{prefix}{name}"
            inner = _split(child, f"{child_path}.")
            if inner:
                layers.extend(inner)
            elif _owns_parameters(child):
                layers.append(child_path)
        return layers
    layers = []
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
