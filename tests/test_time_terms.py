"""The step-time terms a real profile records in ``meta.timing`` (issue 18, point 2):
``optimizer_step_ns_per_param`` and ``microbatch_overhead_ns`` (``profiling.trace.time_terms``).

gpt-tiny (2 layers x 32 hidden) profiled on the CPU in this process with 1 thread takes about a
second; the optimizer rate is checked against a direct timing of Adam over the model's own
parameters, within a loose factor (a shared 2-core machine)."""

from __future__ import annotations

import copy
import math
import statistics
import time

import pytest
import torch

import models
from profiling.executors.base import LEARNING_RATE
from profiling.export import export_graph
from profiling.trace.time_terms import ADAM_LEARNING_RATE, runtime_terms, slope
from solver.errors import InputError
from solver.graph import graph_from_dict, timing_of


@pytest.fixture(scope="module")
def profiled():
    """gpt-tiny profiled for real (1 thread) and with fake tensors."""
    return (
        export_graph("gpt-tiny", dtype="fp32", device="cpu", threads=1),
        export_graph("gpt-tiny", dtype="fp32"),
    )


def _direct_adam_ms(steps: int = 9) -> tuple[float, int]:
    """Median ms of a foreach Adam step over gpt-tiny's own parameters (gradients set), 1 thread,
    and the parameter count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = models.get("gpt-tiny").build()
        params = list(model.parameters())
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer = torch.optim.Adam(params, lr=1e-3, foreach=True)
        optimizer.step()  # warm-up: the state
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            optimizer.step()
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times), sum(p.numel() for p in params)


def test_real_profile_records_both_terms(profiled):
    timing = timing_of(profiled[0])
    rate, overhead = timing["optimizer_step_ns_per_param"], timing["microbatch_overhead_ns"]
    assert isinstance(rate, float) and math.isfinite(rate) and rate > 0
    # max(0, slope - layer sum): 0 when the timer's own hook cost in the layer times exceeds the
    # runtime's per-micro-batch work (tiny models on a CPU; profiling.trace.time_terms)
    assert isinstance(overhead, float) and math.isfinite(overhead) and overhead >= 0
    assert overhead < 1e9  # under a second per micro-batch of a 32k-parameter model
    assert timing["threads"] == 1
    # the layer times come down to the unhooked step's slope (never up); a step's fixed cost
    scale, step = timing["layer_time_scale"], timing["step_overhead_ns"]
    assert 0 < scale <= 1 and (scale == 1 or overhead == 0)
    assert math.isfinite(step) and 0 <= step < 1e9


def test_optimizer_rate_matches_a_direct_timing(profiled):
    rate = timing_of(profiled[0])["optimizer_step_ns_per_param"]
    direct_ms, params = _direct_adam_ms()
    assert params == sum(layer.params for layer in profiled[0].layers)
    predicted_ms = rate * params / 1e6
    # a loose factor: a 0.4 ms step on a shared 2-core machine
    assert direct_ms / 4 <= predicted_ms <= 4 * direct_ms, (predicted_ms, direct_ms)


def test_optimizer_is_the_ranks_adam():
    assert ADAM_LEARNING_RATE == LEARNING_RATE


def test_fake_profile_records_no_terms(profiled):
    assert timing_of(profiled[1]) is None


def test_schema_takes_the_terms_and_rejects_bad_values(profiled):
    document = copy.deepcopy(profiled[0].to_dict())
    assert timing_of(graph_from_dict(document)) == profiled[0].meta["timing"]
    for field, bad in (
        ("optimizer_step_ns_per_param", 0),
        ("optimizer_step_ns_per_param", "fast"),
        ("microbatch_overhead_ns", -1.0),
    ):
        broken = copy.deepcopy(document)
        broken["meta"]["timing"][field] = bad
        with pytest.raises(InputError, match=field):
            graph_from_dict(broken)


def test_slope_is_least_squares():
    assert slope([1, 2, 3], [10.0, 20.0, 30.0]) == pytest.approx(10.0)
    assert slope([1, 2, 3], [10.0, 21.0, 29.0]) == pytest.approx(9.5)  # (29 - 10) / 2
    assert slope([1, 3], [5.0, 9.0]) == pytest.approx(2.0)


def test_overhead_not_measured_for_inputs_that_are_not_batch_tensors():
    def run_loss(*args):
        raise AssertionError("not run")

    cpu = torch.device("cpu")
    for inputs in ((), (torch.ones(2, 3), 5), (torch.ones(2, 3), torch.ones(3, 3))):
        assert runtime_terms(run_loss, inputs, [], layer_ms=1.0, device=cpu) is None


@pytest.mark.parametrize("times", [[3.0, 3.0, 3.0], [3.2, 3.0, 2.9]])
def test_overhead_not_measured_when_the_steps_do_not_grow_with_the_microbatches(monkeypatch, times):
    """A slope <= 0 is noise (seen on a loaded machine): no terms, rather than a negative
    layer_time_scale that the schema refuses."""
    from profiling.trace import time_terms

    monkeypatch.setattr(
        time_terms, "microbatch_step_ms", lambda *a, **k: dict(zip([1, 2, 3], times, strict=True))
    )
    inputs = (torch.ones(2, 3),)
    assert (
        runtime_terms(lambda x: x.sum(), inputs, [], layer_ms=1.0, device=torch.device("cpu"))
        is None
    )
