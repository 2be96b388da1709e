"""Canaries for the private torch APIs of profiling/_torch_compat.py (docs/profiling.md).

One test per entry of ``PRIVATE_APIS`` exercises it minimally, the way profiling/ or the tests use
it; after a torch upgrade, a failure here names the API that broke and the feature that depends
on it. Those that only exist with a process group get a single-process gloo group (world size 1),
in a fresh interpreter (``GROUP_CANARIES``): in the pytest process that had run the rest of the
suite, freeing a DDP reducer after its group was destroyed once hung in ``~ProcessGroupGloo``
(joining gloo's worker threads) and stalled CI past its limit.
The last tests check that a missing API fails where it is used, with its name, and that no other
file of profiling/, tests/ or scripts/ touches a private torch API in code.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from profiling import _torch_compat as compat  # noqa: E402
from profiling._torch_compat import CHECKED_ON, PRIVATE_APIS, TorchInternalsError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent

SHAPE = (1, 2, 8, 4)
"""(batch, heads, sequence, head dim) of the attention canaries."""


@contextlib.contextmanager
def _process_group() -> Iterator[object]:
    """A single-process gloo group and its 1-device CPU mesh, destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dispatched(run) -> list:
    """The aten ops (overloads) that ``run()`` dispatches, seen by a ``TorchDispatchMode``."""
    ops = []

    class Ops(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        run()
    return ops


# -- canaries, one per PRIVATE_APIS entry ---------------------------------------------------------


def _current_autograd_node():
    nodes = []

    class Nodes(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nodes.append(compat.current_autograd_node())
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, requires_grad=True)
    y = x * 3
    with Nodes():
        y.sum().backward()
    assert y.grad_fn in nodes, "no backward op ran under the autograd node of x * 3"
    assert compat.current_autograd_node() is None, "a node outside the backward"


def _dispatch_mode():
    ops = _dispatched(lambda: torch.ones(2, 3) @ torch.ones(3, 4))
    assert torch.ops.aten.mm.default in ops, f"the mode saw {ops}, not aten.mm"


def _tree_map():
    tree = {"a": [1, (2, 3)], "b": 4}
    assert compat.tree_map(lambda x: 10 * x, tree) == {"a": [10, (20, 30)], "b": 40}


def _tree_leaves():
    assert compat.tree_leaves({"a": [1, (2, 3)], "b": 4}) == [1, 2, 3, 4]


def _tree_flatten():
    leaves, _spec = compat.tree_flatten(([1, 2], {"x": 3}))
    assert leaves == [1, 2, 3]


def _fake_tensor_mode():
    with compat.FakeTensorMode(allow_non_fake_inputs=True) as fake:
        big = torch.empty(2**20, 2**20)  # 4 TiB if it were real
        out = big @ fake.from_tensor(torch.ones(2**20, 2))
    assert out.shape == (2**20, 2)


def _flop_registry():
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    flops = compat.flop_registry[torch.ops.aten.mm](a, b, out_val=a @ b)
    assert flops == 2 * 2 * 3 * 4, f"{flops} FLOPs for a 2x3 @ 3x4 matmul"


def _sdpa_flop_count():
    b, h, s, d = SHAPE
    assert compat.sdpa_flop_count(SHAPE, SHAPE, SHAPE) == 2 * 2 * b * h * s * s * d  # 2 matmuls


def _sdpa_backward_flop_count():
    b, h, s, d = SHAPE
    flops = compat.sdpa_backward_flop_count(SHAPE, SHAPE, SHAPE, SHAPE)
    assert flops == 5 * 2 * b * h * s * s * d  # 5 matmuls


def _sdpa_on_cpu() -> set:
    q = torch.randn(*SHAPE, requires_grad=True)
    ops = _dispatched(lambda: F.scaled_dot_product_attention(q, q, q).sum().backward())
    return {op.overloadpacket for op in ops}


def _cpu_flash_attention():
    assert compat.cpu_flash_attention in _sdpa_on_cpu(), "SDPA on CPU runs another kernel"


def _cuda_flash_attention():
    q = torch.empty(SHAPE, dtype=torch.bfloat16, device="meta")
    out, logsumexp, *_, rng_state, unused, _ = compat.cuda_flash_attention(q, q, q, 0.1, True)
    assert out.shape == SHAPE and logsumexp.shape == SHAPE[:3]
    assert logsumexp.dtype == torch.float32
    assert (rng_state.shape, unused.shape) == ((2,), ()), "the flash kernel's RNG state changed"


def _cpu_flash_attention_backward():
    assert compat.cpu_flash_attention_backward in _sdpa_on_cpu(), "SDPA on CPU runs another kernel"


def _local_shard():
    from torch.distributed.tensor import DTensor, Shard

    local = torch.ones(4)
    with _process_group() as mesh:
        shard = compat.local_shard(DTensor.from_local(local, mesh, [Shard(0)]))
    assert type(shard) is torch.Tensor
    assert compat.storage_key(shard.untyped_storage()) == compat.storage_key(
        local.untyped_storage()
    )


def _storage_key():
    x, y = torch.ones(4), torch.ones(4)
    key = compat.storage_key(x.untyped_storage())
    assert isinstance(key, int)
    assert key == compat.storage_key(x.view(2, 2).untyped_storage()), "views differ"
    assert key != compat.storage_key(y.untyped_storage()), "two storages share a key"


def _storage_use_count():
    x = torch.ones(4)
    storage = x.untyped_storage()
    count = compat.storage_use_count(storage)
    assert isinstance(count, int) and count >= 1
    view = x.view(2, 2)
    assert compat.storage_use_count(storage) == count + 1, "a view does not hold the storage"
    del view
    assert compat.storage_use_count(storage) == count, "a dropped view still holds the storage"


def _storage_resize():
    from torch.distributed.fsdp import fully_shard

    original = torch.UntypedStorage.resize_
    sizes = []
    with _process_group() as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        undo = compat.patch_storage_resize(lambda storage: sizes.append(storage.nbytes()))
        try:
            model(torch.ones(2, 4)).sum().backward()
        finally:
            undo()
    assert torch.UntypedStorage.resize_ is original, "the patch was not undone"
    assert 0 in sizes and any(sizes), f"FSDP2 resized unsharded parameters to {sizes} bytes"


def _replicate_with_fsdp():
    from torch.distributed.tensor import DTensor

    with _process_group() as mesh:
        model = nn.Linear(4, 4)
        compat.replicate_with_fsdp(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()
    assert isinstance(model.weight, DTensor) and model.weight.grad is not None


def _rebuild_ddp_buckets():
    from torch.nn.parallel import DistributedDataParallel

    with _process_group():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        compat.rebuild_ddp_buckets(ddp)
        with ddp.no_sync():  # the pipeline's first micro-batch, then the synchronised one
            ddp(torch.ones(2, 4)).sum().backward()
        ddp(torch.ones(2, 4)).sum().backward()
        ddp(torch.ones(2, 4))  # the next step's forward is where a wrong bucket order fails
    assert all(param.grad is not None for param in model.parameters())


def _mem_tracker():
    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    tracker = compat.mem_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        tracker.reset_mod_stats()
        model(torch.ones(8, 64)).sum().backward()
        optimizer.step()
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    param_bytes = (64 * 64 + 64) * 4
    assert snapshot["Total"] >= 4 * param_bytes, "peak below weights + grads + Adam's two states"


def _disable_current_modes():
    def hidden():
        with compat.disable_current_modes():
            torch.ones(2).add(1)

    seen = _dispatched(hidden)
    assert not seen, f"the mode saw {seen} inside disable_current_modes"
    assert _dispatched(lambda: torch.ones(2).add(1)), "the mode saw nothing outside it"


def _interleaved_1f1b_actions():
    actions = compat.interleaved_1f1b_actions(microbatches=4, stages=2, chunks=2, rank=1)
    kinds = [kind for _, kind in actions]
    assert kinds.count("FORWARD") == kinds.count("FULL_BACKWARD") == 4 * 2, actions
    assert {stage for stage, _ in actions} == {1, 3}, actions  # rank 1 holds stages 1 and 3


def _pipeline_stage_base():
    import inspect

    base = compat.pipeline_stage_base()
    parameters = inspect.signature(base.__init__).parameters
    for name in ("stage_module", "stage_index", "pipe_info", "device", "group"):
        assert name in parameters, f"_PipelineStage.__init__ takes no {name}"


def _modify_graph_op_device():
    class Ones(torch.nn.Module):
        def forward(self, x):
            return x + torch.ones(x.size(0), device="cpu")

    module = torch.fx.symbolic_trace(Ones())
    compat.modify_graph_op_device(module, torch.device("meta"))
    devices = [node.kwargs.get("device") for node in module.graph.nodes if "device" in node.kwargs]
    assert devices == [torch.device("meta")], f"device arguments not moved: {devices}"


CANARIES = {
    "torch._C._current_autograd_node": _current_autograd_node,
    "torch.utils._python_dispatch.TorchDispatchMode": _dispatch_mode,
    "torch.utils._python_dispatch._disable_current_modes": _disable_current_modes,
    "torch.utils._pytree.tree_map": _tree_map,
    "torch.utils._pytree.tree_leaves": _tree_leaves,
    "torch.utils._pytree.tree_flatten": _tree_flatten,
    "torch._subclasses.fake_tensor.FakeTensorMode": _fake_tensor_mode,
    "torch.utils.flop_counter.flop_registry": _flop_registry,
    "torch.utils.flop_counter.sdpa_flop_count": _sdpa_flop_count,
    "torch.utils.flop_counter.sdpa_backward_flop_count": _sdpa_backward_flop_count,
    "torch.ops.aten._scaled_dot_product_flash_attention": _cuda_flash_attention,
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": _cpu_flash_attention,
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": (
        _cpu_flash_attention_backward
    ),
    "torch.distributed.tensor.DTensor._local_tensor": _local_shard,
    "torch.UntypedStorage._cdata": _storage_key,
    "torch._C._storage_Use_Count": _storage_use_count,
    "torch.UntypedStorage.resize_": _storage_resize,
    "torch.distributed._composable.replicate_with_fsdp.replicate": _replicate_with_fsdp,
    "torch.nn.parallel.DistributedDataParallel.reducer._push_all_rebuilt_params": (
        _rebuild_ddp_buckets
    ),
    "torch.nn.parallel.DistributedDataParallel.reducer._rebuild_buckets": _rebuild_ddp_buckets,
    "torch.distributed._tools.mem_tracker.MemTracker": _mem_tracker,
    "torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B"
    "._calculate_single_rank_operations": _interleaved_1f1b_actions,
    "torch.distributed.pipelining.stage._PipelineStage": _pipeline_stage_base,
    "torch.distributed.pipelining._IR._modify_graph_op_device": _modify_graph_op_device,
}


GROUP_CANARIES = frozenset(
    name
    for name, canary in CANARIES.items()
    if "_process_group" in canary.__code__.co_names
)
"""The canaries that make a gloo process group: run in their own interpreter."""

CANARY_TIMEOUT_S = 120
"""Wall-clock limit of a canary in its own interpreter (it takes about 5 s)."""


def _run_in_fresh_interpreter(name: str) -> None:
    """Run canary ``name`` in a new Python process; raise with its output if it fails."""
    code = f"from tests.test_torch_compat import CANARIES; CANARIES[{name!r}]()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=CANARY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"did not finish within {CANARY_TIMEOUT_S} s") from error
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "no output")


def test_every_private_api_has_a_canary():
    assert sorted(CANARIES) == sorted(PRIVATE_APIS)


def test_the_process_group_canaries_are_found():
    assert GROUP_CANARIES == {
        "torch.distributed.tensor.DTensor._local_tensor",
        "torch.UntypedStorage.resize_",
        "torch.distributed._composable.replicate_with_fsdp.replicate",
        "torch.nn.parallel.DistributedDataParallel.reducer._push_all_rebuilt_params",
        "torch.nn.parallel.DistributedDataParallel.reducer._rebuild_buckets",
    }


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_private_api(name):
    what, used_by = PRIVATE_APIS[name]
    try:
        if name in GROUP_CANARIES:
            _run_in_fresh_interpreter(name)
        else:
            CANARIES[name]()
    except Exception as error:
        raise AssertionError(
            f"torch {torch.__version__}: {name} broke (checked on {CHECKED_ON}): "
            f"{type(error).__name__}: {error}\n{used_by} needs it to {what}"
        ) from error


def test_a_missing_private_api_fails_where_used_with_its_name(monkeypatch):
    name = "torch.utils._no_such_module.Thing"
    monkeypatch.setitem(PRIVATE_APIS, name, ("do a thing", "profiling/x.py"))
    stand_in = compat._private(name)
    message = re.escape(
        f"torch {torch.__version__} has no {name} "
        f"(checked on {CHECKED_ON}; used by profiling/x.py to do a thing)"
    )
    with pytest.raises(TorchInternalsError, match=message):
        stand_in(1, key=2)
    with pytest.raises(TorchInternalsError, match=message):
        dict(**stand_in)  # FLOP_FORMULAS = {**flop_registry, ...}

    class Sub(stand_in):  # defining a subclass works (modules still import) ...
        pass

    with pytest.raises(TorchInternalsError, match=message):  # ... making one does not
        Sub()


# -- no private torch API outside _torch_compat.py -----------------------------------------------

PRIVATE_CODE = re.compile(
    r"torch\._(?!_)|torch\.utils\._|_local_tensor|reducer\._|_composable|_tools\.|_subclasses"
    r"|_cdata|_overloadpacket|_scaled_dot_product_flash|UntypedStorage\.resize_=(?!=)"
    r"|_calculate_single_rank_operations|_ComputationType"
    r"|^from torch\S* import\b.*\b_(?!_)"
    r"|flop_counter import\b.*\b(flop_registry|sdpa_\w*flop_count)\b"
)
"""A private torch API in a line of code (``torch.__version__`` is public; patching
``UntypedStorage.resize_`` counts, reading it does not)."""


def _is_code(token: tokenize.TokenInfo) -> bool:
    """Not a comment, string (docstrings, f-string text) or layout token."""
    kind = tokenize.tok_name[token.type]
    return kind not in ("COMMENT", "STRING", "NL", "INDENT", "DEDENT") and "STRING_" not in kind


def _code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, code) of each logical line; tokens are joined without spaces but for
    one between two names (``import torch``)."""
    code, start, previous = "", None, None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if code:
                yield start, code
            code, start, previous = "", None, None
        elif _is_code(token):
            if previous == token.type == tokenize.NAME:
                code += " "
            code += token.string
            start = start or token.start[0]
            previous = token.type


def _private_uses(text: str) -> list[tuple[int, str]]:
    return [(line, code) for line, code in _code_lines(text) if PRIVATE_CODE.search(code)]


def test_the_scan_sees_code_only():
    text = '''"""torch._C in a docstring."""
import torch  # torch._C in a comment
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
)
from torch import nn, _C
print(torch.__version__, "torch._C", f"{x!r:>10}")
node = torch._C._current_autograd_node()
torch.UntypedStorage.resize_ = torch.UntypedStorage.resize_
'''
    assert [line for line, _ in _private_uses(text)] == [3, 7, 9, 10]


@pytest.mark.slow
def test_no_private_torch_api_outside_torch_compat():
    compat_file = ROOT / "profiling" / "_torch_compat.py"
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for folder in ("profiling", "tests", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != compat_file
        for line, code in _private_uses(path.read_text())
    ]
    assert not hits, "private torch API outside profiling/_torch_compat.py:\n" + "\n".join(hits)
