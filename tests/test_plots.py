"""Plots: files are written (PNG, non-trivial), infeasible sweep points are drawn, bad paths are
one-line errors before any work, and an input file is never overwritten."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import solver.report.plots
from solver import Cluster, TrainingConfig, plan
from solver.cli import evaluate_main, plan_main
from solver.errors import InputError
from solver.report.plots import check_plot_path, plot_pareto, plot_plan, plot_sweep
from tests.conftest import GPT_1_3B, ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GIB = 2**30


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000


@pytest.fixture(scope="module")
def small_plan(gpt_graph):
    return plan(
        gpt_graph,
        Cluster(num_gpus=8, gpu_memory_bytes=40 * GIB),
        TrainingConfig(global_batch=32, pp=4, tp=2),
    )


def captured_figure(monkeypatch) -> list:
    """Replace the file writer: keep the figure for inspection, write nothing."""
    figures = []
    monkeypatch.setattr(solver.report.plots, "_save", lambda figure, target: figures.append(figure))
    return figures


def legend_texts(figure) -> set[str]:
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes]
    return {text.get_text() for legend in legends if legend for text in legend.get_texts()}


@pytest.mark.slow
def test_plot_plan_with_even_baseline_writes_png(small_plan, tmp_path):
    out = plot_plan(
        small_plan.evaluation, tmp_path / "plan.png", baseline=small_plan.baselines["even"]
    )
    assert_png(out)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temporary left behind


def test_plot_plan_panels_share_scale_and_show_every_component(small_plan, monkeypatch):
    figures = captured_figure(monkeypatch)
    plot_plan(small_plan.evaluation, "x.png", baseline=small_plan.baselines["even"])
    (figure,) = figures
    plan_ax, even_ax = figure.axes
    assert plan_ax.get_ylim() == even_ax.get_ylim()
    assert len(plan_ax.patches) == 6 * small_plan.config.pp  # one segment per component and stage
    assert {"weights", "gradients", "optimizer states", "activations"} <= legend_texts(figure)
    assert "% less than the even split" in figure._suptitle.get_text()


@pytest.mark.slow
def test_plot_sweep_draws_infeasible_points(monkeypatch, tmp_path):
    rows = [
        sweep_row(64, 80, "OPTIMAL", peak=70, throughput=10.0),
        sweep_row(128, 80, "OPTIMAL", peak=50, throughput=19.0),
        sweep_row(64, 40, "INFEASIBLE", peak=None, throughput=None),
        sweep_row(128, 40, "INFEASIBLE", peak=45, throughput=None),
        sweep_row(256, 40, "OPTIMAL", peak=30, throughput=30.0),
        sweep_row(256, 80, "ERROR", peak=None, throughput=None),
    ]
    assert_png(plot_sweep(rows, tmp_path / "sweep.png", title="test sweep"))
    figures = captured_figure(monkeypatch)
    plot_sweep(rows, "sweep.png")
    memory_ax, speed_ax = figures[0].axes
    assert "no plan fits" in legend_texts(figures[0])
    assert memory_ax.get_xscale() == "log"
    crosses = [c for c in memory_ax.collections if len(c.get_offsets())]
    assert len(crosses) == 3  # two infeasible points and one error, none dropped
    marked = sorted(tuple(c.get_offsets()[0]) for c in crosses)
    assert marked == [(64, 40.0), (128, 45.0), (256, 80.0)]  # at capacity, at best peak


def sweep_row(gpus: int, memory_gib: int, status: str, *, peak, throughput) -> dict:
    solved = peak is not None and status != "INFEASIBLE"
    return {
        "gpus": gpus,
        "gpu_memory_bytes": memory_gib * GIB,
        "status": status,
        "config": "pp8 tp8 dp1" if solved else None,
        "peak_bytes": None if peak is None else peak * GIB,
        "throughput": throughput,
        "fits": solved,
        "even_peak_bytes": 1.2 * peak * GIB if solved else None,
        "even_throughput": throughput,
        "parameters_peak_bytes": 1.1 * peak * GIB if solved else None,
        "parameters_throughput": throughput,
    }


def test_plot_pareto_writes_png(small_plan, tmp_path):
    points = [
        small_plan.evaluation,
        {"peak_bytes": 30 * GIB, "throughput": 5.0, "config": small_plan.config.to_dict()},
    ]
    assert_png(plot_pareto(points, tmp_path / "front.png", capacity_bytes=40 * GIB))


@pytest.mark.slow
def test_plot_pareto_of_a_heterogeneous_front(small_plan, tmp_path):
    """Utilization on the x axis (from the JSON's max_utilization), or a capacity per group."""
    config = small_plan.config.to_dict()
    points = [
        {"peak_bytes": 30 * GIB, "max_utilization": 0.75, "throughput": 5.0, "config": config},
        {"peak_bytes": 35 * GIB, "max_utilization": 0.5, "throughput": 4.0, "config": config},
    ]
    groups = [("a100-40g", 40 * GIB), ("a100-80g", 80 * GIB)]
    assert_png(plot_pareto(points, tmp_path / "u.png", group_capacities=groups, utilization=True))
    assert_png(plot_pareto(points, tmp_path / "b.png", group_capacities=groups))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing/plot.png", "does not exist"),
        ("plot.jpgx", "unsupported extension"),
        ("plot", "unsupported extension"),
    ],
)
def test_check_plot_path_rejects_bad_paths(tmp_path, name, message):
    with pytest.raises(InputError, match=message):
        check_plot_path(tmp_path / name)


def test_check_plot_path_protects_inputs_and_folders(tmp_path):
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(InputError, match="is a folder"):
        check_plot_path(tmp_path / "dir.png")
    graph = tmp_path / "graph.png"
    graph.write_text("{}")
    with pytest.raises(InputError, match="input file"):
        check_plot_path(graph, protect=[str(graph)])
    assert check_plot_path(tmp_path / "ok.svg") == tmp_path / "ok.svg"


PLAN_ARGS = ("--gpus", "8", "--global-batch", "32", "--pp", "4", "--tp", "2", "--quiet")
EVALUATE_ARGS = ("--pp", "4", "--tp", "2", "--global-batch", "32", "--quiet")


@pytest.mark.slow
def test_plan_and_evaluate_cli_write_plots(run_cli, tmp_path):
    plan_png, evaluate_png = tmp_path / "plan.png", tmp_path / "evaluate.png"
    code, _, err = run_cli(plan_main, GPT_1_3B, *PLAN_ARGS, "--plot", str(plan_png))
    assert code == 0, err
    assert_png(plan_png)
    code, _, err = run_cli(
        evaluate_main,
        GPT_1_3B,
        *EVALUATE_ARGS,
        "--split",
        "5,7,7,7",
        "--plot",
        str(evaluate_png),
    )
    assert code == 0, err
    assert_png(evaluate_png)


def test_evaluate_plot_compares_with_even_split_unless_it_is_even(monkeypatch, run_cli):
    figures = captured_figure(monkeypatch)
    for split in ("5,7,7,7", "even"):
        code, _, err = run_cli(
            evaluate_main, GPT_1_3B, *EVALUATE_ARGS, "--split", split, "--plot", "x.png"
        )
        assert code == 0, err
    assert [len(figure.axes) for figure in figures] == [2, 1]


@pytest.mark.parametrize("main", [plan_main, evaluate_main])
@pytest.mark.parametrize("name", ["missing/plan.png", "plan.txt"])
def test_cli_bad_plot_path_is_one_line_exit_2_before_solving(
    main, name, run_cli, tmp_path, monkeypatch
):
    def fail(*args, **kwargs):
        raise AssertionError("solved before checking --plot")

    monkeypatch.setattr("solver.search.planner.plan", fail)
    monkeypatch.setattr("solver.evaluation.evaluate", fail)
    args = PLAN_ARGS if main is plan_main else (*EVALUATE_ARGS, "--split", "even")
    code, out, err = run_cli(main, GPT_1_3B, *args, "--plot", str(tmp_path / name))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--plot" in err and "Traceback" not in err


def test_cli_never_overwrites_the_graph(run_cli, tmp_path):
    graph = tmp_path / "graph.png"  # a graph file whose name looks like a plot
    graph.write_text(Path(GPT_1_3B).read_text())
    before = graph.read_bytes()
    for main, args in (
        (plan_main, PLAN_ARGS),
        (evaluate_main, (*EVALUATE_ARGS, "--split", "even")),
    ):
        code, _, err = run_cli(main, str(graph), *args, "--plot", str(graph))
        assert code == 2 and "input file" in err and err.count("\n") == 1
    code, _, err = run_cli(
        plan_main, str(graph), *PLAN_ARGS, "--plot", str(tmp_path / "p.png"),
        "--json", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert code == 2 and "same file as --json" in err
    assert graph.read_bytes() == before


@pytest.mark.slow
def test_importing_solver_does_not_import_matplotlib():
    code = (
        "import sys, solver, solver.cli, solver.report.plots; "
        "assert 'matplotlib' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
