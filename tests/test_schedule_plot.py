"""The schedule picture (``--plot-schedule``): each rank's memory at every action comes from the
cost model (its largest value is the stage's predicted peak, exactly), its actions and times are
the simulation's (the last rank end is the iteration), the figure carries those data, and bad
paths are one-line errors before any work."""

from __future__ import annotations

import os
import random

import pytest

from solver import Cluster, ParallelConfig, TrainingConfig, evaluate
from solver.cli import evaluate_main, plan_main
from solver.costs import layer_costs, rank_memory, schedule_actions, stage_costs
from solver.graph import graph_from_dict
from solver.parallel import ZERO_BUBBLE_SCHEDULES
from solver.report.schedule_plot import (
    figure_scale,
    memory_curve,
    schedule_figure,
    schedule_series,
)
from tests.conftest import GPT_1_3B
from tests.random_graphs import random_chain, random_dag, random_layer, with_unsaved_output

GIB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _case(seed: int, schedule: str, v: int, runtime: str, lifetime: str):
    """A random small graph, config, training and split (seeded)."""
    rng = random.Random(seed)
    layers = rng.randint(6, 12)
    graph = random_chain(rng, layers) if seed % 2 else random_dag(rng, layers)
    # torch: the output its pipeline keeps for the loss, in every third case
    graph = with_unsaved_output(graph, 700 if seed % 3 == 0 else 0)
    p = rng.choice([2, 3]) if v > 1 else rng.choice([1, 2, 3, 4])
    m = rng.choice([1, 2, 3, 5, 8]) * (p if v > 1 else 1)
    if schedule == "dualpipev":  # torch's rule: m >= 2p
        m = rng.choice([2, 3, 5]) * p
    elif schedule in ZERO_BUBBLE_SCHEDULES:  # zbv pads m below 2p - 1: idle steps
        m = rng.choice([1, 2, 3, 4, 5, 8])
        m -= m % max(1, m // p) if schedule == "interleaved-zb" else 0
    recompute = rng.choice(["none", "full", "selective"])
    config = ParallelConfig(
        pp=p,
        tp=1,
        dp=1,
        micro_batch=1,
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
        recompute=recompute,
    )
    training = TrainingConfig(
        global_batch=m,
        schedule=schedule,
        virtual_stages=(v,),
        recompute=recompute,
        runtime=runtime,
        grad_lifetime=lifetime,
        deallocate_pipeline_outputs=rng.random() < 0.5,
    )
    costs = layer_costs(graph, config, Cluster(num_gpus=p), training)
    split = sorted(rng.randrange(p * v) for _ in range(layers))
    recomputed = [rng.random() < 0.5 for _ in range(layers)] if recompute == "selective" else None
    return costs, split, recomputed


CASES = [
    (schedule, v, runtime, lifetime)
    for schedule, v in (
        ("1f1b", 1),
        ("gpipe", 1),
        ("1f1b", 2),
        ("zbv", 2),
        ("dualpipev", 2),
        ("interleaved-zb", 2),
        ("interleaved-zb", 1),
    )
    for runtime, lifetime in (
        ("megatron", "persistent"),
        ("torch", "persistent"),
        ("torch", "step"),
    )
]
"""Megatron keeps its gradients for the run (``grad_lifetime`` step is torch's). The
split-backward schedules (zbv, dualpipev, interleaved-zb): their stage peaks count the pending
W steps' dY as the replay does."""


@pytest.mark.parametrize(("schedule", "v", "runtime", "lifetime"), CASES)
def test_largest_memory_over_the_actions_is_the_stage_peak(schedule, v, runtime, lifetime):
    checked = 0
    for seed in range(12):
        costs, split, recomputed = _case(seed, schedule, v, runtime, lifetime)
        stages = stage_costs(costs, split, recomputed)
        m = costs.config.num_microbatches
        for stage, memory in zip(stages, rank_memory(costs, split, recomputed), strict=True):
            assert memory.peak_bytes == stage.peak_bytes, (seed, stage.index, stage.moment)
            kinds = [action.kind for action in memory.actions]
            assert kinds.count("F") == m * v
            assert kinds.count("B") + kinds.count("W") == m * v
            assert kinds.count("I") == kinds.count("W")
            assert len(kinds) == (3 if schedule in ZERO_BUBBLE_SCHEDULES else 2) * m * v - (
                kinds.count("B") if schedule in ZERO_BUBBLE_SCHEDULES else 0
            )
            assert min(memory.action_bytes) >= memory.states_bytes >= 0
            checked += 1
    assert checked >= 24


def test_one_f_one_b_memory_follows_the_micro_batches_held():
    """Rank 0 of 1F1B, p 2, m 3: F0 F1 B0 F2 B1 B2 hold 1 2 1 2 1 0 micro-batches; with
    megatron's constant buffers each step adds or frees exactly one micro-batch's kept bytes."""
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=3)
    training = TrainingConfig(global_batch=3, runtime="megatron")
    graph_costs = layer_costs(_graph(), config, Cluster(num_gpus=2), training)
    split = [0, 0, 0, 1, 1, 1]
    first = rank_memory(graph_costs, split)[0]
    assert [(a.kind, a.microbatch) for a in first.actions] == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2),
    ]  # fmt: skip
    held = [1, 2, 1, 2, 1, 0]
    kept = first.action_bytes[1] - first.action_bytes[0]
    assert kept == sum(int(graph_costs.stored_bytes[layer]) for layer in range(3)) > 0
    base = first.action_bytes[0] - kept
    assert list(first.action_bytes) == [base + n * kept for n in held]
    assert first.peak_bytes == stage_costs(graph_costs, split)[0].peak_bytes


def _graph():
    return random_chain(random.Random(5), 6)


@pytest.fixture(scope="module")
def interleaved(gpt_graph):
    config = ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=8, virtual_stages=2)
    training = TrainingConfig(global_batch=8, virtual_stages=(2,))
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=16 * GIB)
    return evaluate(gpt_graph, config, "even", cluster=cluster, training=training)


@pytest.fixture(scope="module")
def gpipe(gpt_graph):
    config = ParallelConfig(
        pp=2, tp=2, dp=1, micro_batch=1, num_microbatches=4, schedule="gpipe", sp=True
    )
    training = TrainingConfig(
        global_batch=4, schedule="gpipe", runtime="torch", grad_lifetime="step"
    )
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=16 * GIB)
    return evaluate(gpt_graph, config, [12, 14], cluster=cluster, training=training)


@pytest.fixture(scope="module")
def zbv(gpt_graph):
    """torch's ZBV on 2 ranks: rank 0 runs the first chunk (embedding) and the last (head)."""
    config = ParallelConfig(
        pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, virtual_stages=2, schedule="zbv"
    )
    training = TrainingConfig(
        global_batch=4, virtual_stages=(2,), schedule="zbv", runtime="torch", grad_lifetime="step"
    )
    cluster = Cluster(num_gpus=2, gpu_memory_bytes=16 * GIB)
    return evaluate(gpt_graph, config, "even", cluster=cluster, training=training)


@pytest.mark.parametrize("name", ["interleaved", "gpipe", "zbv"])
def test_series_are_the_simulation_and_the_model(name, request):
    evaluation = request.getfixturevalue(name)
    series, makespan = schedule_series(evaluation)
    config = evaluation.config
    assert makespan == evaluation.iteration_ns > 0
    if name == "gpipe":  # torch's foreach Adam: the optimizer step is a moment of its own
        assert all(rank.step_bytes is not None for rank in series)
    assert max(rank.end_of_rank_ns for rank in series) == evaluation.iteration_ns
    group = config.pp if config.virtual_stages > 1 else None
    for rank, stage in zip(series, evaluation.stages, strict=True):
        assert rank.actions == schedule_actions(
            config.num_microbatches, config.pp, config.virtual_stages, rank.rank, group,
            config.schedule,
        )  # fmt: skip
        assert max(rank.action_bytes + ((rank.step_bytes,) if rank.step_bytes else ())) == (
            stage.peak_bytes
        )
        for action, s, e in zip(rank.actions, rank.start_ns, rank.end_ns, strict=True):
            # torch runs no I step on virtual stage 0 (its W is the whole backward): 0 ns
            empty = action.kind == "I" and rank.rank == 0 and action.chunk == 0
            assert s == e if empty else s < e, (rank.rank, action)
        assert all(e <= s for e, s in zip(rank.end_ns, rank.start_ns[1:], strict=False))


def _lines(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


@pytest.mark.parametrize("name", [pytest.param("interleaved", marks=pytest.mark.slow), "gpipe"])
def test_figure_carries_actions_memory_peak_and_capacity(name, request):
    evaluation = request.getfixturevalue(name)
    series, makespan = schedule_series(evaluation)
    scale = figure_scale(series, makespan)
    assert (scale.time_unit, scale.memory_unit) == ("ms", "GiB")
    figure = schedule_figure(evaluation)
    config = evaluation.config
    assert len(figure.axes) == 2 * config.pp
    v = config.virtual_stages
    for rank in series:
        row, memory = figure.axes[2 * rank.rank], figure.axes[2 * rank.rank + 1]
        assert row.get_yticklabels()[0].get_text() == f"rank {rank.rank}"
        boxes = {c.get_label(): c for c in row.collections}
        for kind in "FB":
            drawn = sum(len(boxes[f"{kind} chunk {c}"].get_paths()) for c in range(v))
            assert drawn == config.num_microbatches * v
        texts = {t.get_text() for t in row.texts}
        expected = {
            f"{a.microbatch}.{a.chunk}" if v > 1 else str(a.microbatch) for a in rank.actions
        }
        assert texts and texts <= expected
        lines = _lines(memory)
        curve = lines["predicted memory"]
        xs, ys = memory_curve(rank)
        assert list(curve.get_xdata()) == [x / 1e6 for x in xs]
        assert list(curve.get_ydata()) == [y / GIB for y in ys]
        peak = lines[next(label for label in lines if label.startswith("predicted peak"))]
        assert list(peak.get_ydata()) == [rank.peak_bytes / GIB] * 2 == [max(ys) / GIB] * 2
        usable = lines[next(label for label in lines if label.startswith("usable"))]
        assert list(usable.get_ydata()) == [evaluation.usable_bytes[rank.rank] / GIB] * 2
        assert memory.get_ylim() == (0, scale.top) and scale.top > usable.get_ydata()[0]
        assert memory.get_ylabel() == "GiB"
    assert figure.axes[-1].get_xlim() == (0, evaluation.iteration_ns / 1e6)
    legend = {text.get_text() for legend in figure.legends for text in legend.get_texts()}
    assert {"F: forward", "B: backward", "usable GPU memory", "predicted peak"} <= legend


def test_measured_memory_is_drawn_over_the_prediction(gpipe):
    series, makespan = schedule_series(gpipe)
    measured = {1: [value - 1000 for value in series[1].action_bytes]}
    figure = schedule_figure(gpipe, measured=measured)
    lines = _lines(figure.axes[3])
    label = next(label for label in lines if label.startswith("measured"))
    ys = memory_curve(series[1], measured[1])[1]
    assert list(lines[label].get_ydata()) == [y / GIB for y in ys]
    assert not any(label.startswith("measured") for label in _lines(figure.axes[1]))


def test_a_graph_without_times_shows_the_order_in_slots_and_small_memory_in_its_unit():
    """No layer times: forwards take one slot, backwards two; a tiny model's memory in KiB with
    the usable memory of an 80 GiB GPU out of view, said in words."""
    rng = random.Random(3)
    layers = [random_layer(rng, f"l{i}") | {"fwd_flops": 0.0} for i in range(4)]
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=3)
    evaluation = evaluate(graph, config, "even")
    assert evaluation.iteration_ns == 0
    series, makespan = schedule_series(evaluation)
    slots = zip(series[1].start_ns, series[1].end_ns, strict=True)
    assert [(end - start) // 10**6 for start, end in slots] == [1, 2, 1, 2, 1, 2]
    figure = schedule_figure(evaluation)
    assert figure.axes[-1].get_xlabel().startswith("schedule slots")
    memory = figure.axes[1]
    assert memory.get_ylabel() == figure_scale(series, makespan).memory_unit in ("KiB", "MiB")
    assert any(text.get_text().endswith("(above)") for text in memory.texts)


@pytest.mark.slow
def test_plan_and_evaluate_write_the_schedule(run_cli, tmp_path):
    plan_png, evaluate_svg = tmp_path / "plan.png", tmp_path / "evaluate.svg"
    args = ("--gpus", "8", "--global-batch", "16", "--pp", "2", "--tp", "4", "--quiet")
    code, out, err = run_cli(plan_main, GPT_1_3B, *args, "--plot-schedule", str(plan_png))
    assert (code, out, err) == (0, "", "")
    assert plan_png.read_bytes()[:8] == PNG_MAGIC
    code, out, err = run_cli(
        evaluate_main, GPT_1_3B, "--pp", "4", "--global-batch", "8", "--virtual-stages", "2",
        "--split", "even", "--quiet", "--plot-schedule", str(evaluate_svg),
    )  # fmt: skip
    assert (code, out, err) == (0, "", "")
    assert b"<svg" in evaluate_svg.read_bytes()[:400]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["evaluate.svg", "plan.png"]


EVALUATE = ("--pp", "2", "--global-batch", "8", "--split", "even", "--quiet")


@pytest.mark.parametrize("main", [plan_main, evaluate_main])
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing/s.png", "does not exist"),
        ("s.jpg", "unsupported extension '.jpg'"),
        ("folder.png", "is a folder"),
        ("graph.png", "input file"),
        ("plot.png", "same file as --plot"),
    ],
)
def test_bad_schedule_path_is_one_line_exit_2_before_any_work(
    main, name, message, run_cli, tmp_path, monkeypatch
):
    def fail(*args, **kwargs):
        raise AssertionError("solved before checking --plot-schedule")

    monkeypatch.setattr("solver.search.planner.plan", fail)
    monkeypatch.setattr("solver.evaluation.evaluate", fail)
    (tmp_path / "folder.png").mkdir()
    graph = tmp_path / "graph.png"
    graph.write_bytes(open(GPT_1_3B, "rb").read())
    args = ("--gpus", "2", "--global-batch", "8", "--quiet") if main is plan_main else EVALUATE
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(
        main, str(graph), *args, "--plot", str(tmp_path / "plot.png"),
        "--plot-schedule", str(tmp_path / name),
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert "--plot-schedule" in err and message in err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_unwritable_folder_is_one_line_exit_2(run_cli, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        code, _, err = run_cli(
            evaluate_main, GPT_1_3B, *EVALUATE, "--plot-schedule", str(folder / "s.png")
        )
    finally:
        folder.chmod(0o700)
    assert code == 2 and err.count("\n") == 1 and "--plot-schedule" in err


def test_schedule_of_a_pareto_front_is_refused(run_cli, tmp_path):
    code, out, err = run_cli(
        plan_main, GPT_1_3B, "--gpus", "2", "--global-batch", "8", "--pareto",
        "--plot-schedule", str(tmp_path / "s.png"),
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1 and "--pareto" in err
    assert list(tmp_path.iterdir()) == []
