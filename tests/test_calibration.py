"""Calibration of the memory model: the fit, leave-one-out, the file format, the CLIs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from profiling import calibrate as calibrate_cli
from profiling.export import export_graph
from solver import Cluster, TrainingConfig, plan
from solver.calibration import (
    COMPONENTS,
    MIN_SCALE,
    Calibration,
    Sample,
    fit_calibration,
    leave_one_out,
    load_calibration,
    write_calibration,
)
from solver.cli import evaluate_main, plan_main
from solver.errors import InputError
from solver.report.plan_report import plan_to_dict
from tests.conftest import GPT_1_3B

TRUE_STATES, TRUE_ACTIVATIONS, TRUE_BUFFERS, TRUE_CONSTANT = 1.07, 0.83, 1.9, 123_457
TINY = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab_size": 128, "dropout": 0.0}


def synthetic(num_groups: int = 4, ranks: int = 3, seed: int = 0) -> list[Sample]:
    """Breakdowns of 1e6..1e8 bytes; measured = the true calibration, exactly (no rounding)."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        for _ in range(ranks):
            b = {name: int(rng.integers(10**6, 10**8)) for name in COMPONENTS}
            measured = (
                TRUE_STATES * (b["weights"] + b["grads"] + b["optimizer"])
                + TRUE_ACTIVATIONS * b["activations"]
                + TRUE_BUFFERS * (b["buffers"] + b["transient"])
                + TRUE_CONSTANT
            )
            samples.append(Sample(b, measured, f"config{group}"))
    return samples


# -- the calibration itself --------------------------------------------------------------------


def test_apply_rounds_each_scaled_component_up_and_adds_the_constant():
    calibration = Calibration(scales={"weights": 1.5, "activations": 0.1}, constant_bytes=-7)
    breakdown = {"weights": 3, "grads": 5, "activations": 11}
    # ceil(4.5) + 5 + ceil(1.1) - 7 (0.1 is slightly above 1/10 as a float: still 2)
    assert calibration.apply(breakdown) == 5 + 5 + 2 - 7
    identity = Calibration()
    assert identity.apply(breakdown) == 19  # every scale 1, constant 0
    assert Calibration(scales={"grads": 0.5}).apply({"grads": 3}) == 2  # ceil(1.5)


def test_training_config_with_a_calibration_stays_hashable_and_compares_on_the_numbers():
    first = Calibration(scales={"weights": 1.1}, constant_bytes=5, meta={"date": "a"})
    second = Calibration(scales={"weights": 1.1, "grads": 1.0}, constant_bytes=5, meta={})
    a = TrainingConfig(global_batch=4, calibration=first)
    b = TrainingConfig(global_batch=4, calibration=second)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != TrainingConfig(global_batch=4, calibration=Calibration(constant_bytes=6))
    with pytest.raises(InputError, match="calibration must be"):
        TrainingConfig(global_batch=4, calibration={"weights": 1.0})


@pytest.mark.slow
def test_calibration_module_imports_without_torch():
    code = (
        "import sys, solver.calibration, solver.cli; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the fit -----------------------------------------------------------------------------------


def test_fit_recovers_known_factors():
    calibration = fit_calibration(synthetic())
    for name in ("weights", "grads", "optimizer"):
        assert calibration.scales[name] == pytest.approx(TRUE_STATES, abs=1e-6)
    assert calibration.scales["activations"] == pytest.approx(TRUE_ACTIVATIONS, abs=1e-6)
    for name in ("buffers", "transient"):
        assert calibration.scales[name] == pytest.approx(TRUE_BUFFERS, abs=1e-6)
    assert calibration.constant_bytes == TRUE_CONSTANT
    assert calibration.meta["fitted"] == ["states", "activations", "buffers", "constant"]
    assert max(abs(r) for r in calibration.meta["residuals_pct"]) < 1e-4


def test_fit_keeps_unidentifiable_parameters_analytic():
    # One rank: only the first parameter (states) can be fitted; the rest stay analytic.
    sample = Sample({"weights": 100, "activations": 50, "buffers": 10}, 260.0, "only")
    calibration = fit_calibration([sample])
    assert calibration.meta["fitted"] == ["states"]
    assert calibration.meta["fixed"] == ["activations", "buffers", "constant"]
    assert calibration.scales["activations"] == calibration.scales["buffers"] == 1.0
    assert calibration.constant_bytes == 0
    assert calibration.scales["weights"] == pytest.approx(260 / 100)  # 1 row: exact fit
    # a component that is 0 everywhere carries no information: its scale stays 1
    no_buffers = [Sample({"weights": w, "activations": 2 * w + 1}, 3 * w, "g") for w in (5, 7, 9)]
    assert "buffers" in fit_calibration(no_buffers).meta["fixed"]


def test_fit_keeps_every_scale_at_least_the_minimum():
    # measured falls as activations grow: the unconstrained fit would give activations < 0
    samples = [
        Sample({"weights": 1000, "activations": 100 * k}, 2000 - 50 * k, f"g{k}") for k in range(4)
    ]
    calibration = fit_calibration(samples, fit_constant=False)
    unconstrained, *_ = np.linalg.lstsq(
        np.array([[1000, 100 * k] for k in range(4)], dtype=float)
        / np.array([2000 - 50 * k for k in range(4)], dtype=float)[:, None],
        np.ones(4),
        rcond=None,
    )
    assert unconstrained[1] < 0
    assert calibration.scales["activations"] == MIN_SCALE
    # the weights scale is the least-squares fit with activations pinned at the bound
    measured = np.array([2000 - 50 * k for k in range(4)], dtype=float)
    rest = (measured - MIN_SCALE * 100 * np.arange(4)) / measured
    (weights,), *_ = np.linalg.lstsq((1000 / measured)[:, None], rest, rcond=None)
    assert calibration.scales["weights"] == pytest.approx(weights, rel=1e-9)


def test_fit_outside_the_ranges_is_an_input_error():
    """Runs a million times the model's weights, or a constant of an exabyte on every rank:
    not a calibration of this model, an InputError that says which number and its range."""
    scaled = [Sample({"weights": 1000 * k}, 1e9 * k, f"g{k}") for k in (1, 2, 3)]
    with pytest.raises(InputError) as caught:
        fit_calibration(scaled, fit_constant=False)
    text = str(caught.value)
    assert text.startswith("calibration fit: scales.weights: 1000000")
    assert "must be a finite number in [0.01, 100]" in text and "do not follow the model" in text
    constant = [
        Sample({"weights": 1000 * k, "activations": 7 * k**2}, 1e18, f"g{k}") for k in (1, 2, 3)
    ]
    with pytest.raises(InputError, match=r"calibration fit: constant_bytes: .* in -2\^40\.\.2\^40"):
        fit_calibration(constant)


def test_fit_rejects_empty_and_non_positive_samples():
    with pytest.raises(InputError, match="no samples"):
        fit_calibration([])
    with pytest.raises(InputError, match="must be a finite number of bytes > 0"):
        fit_calibration([Sample({"weights": 1}, 0, "g")])
    with pytest.raises(InputError, match="unknown component"):
        fit_calibration([Sample({"weight": 1}, 1, "g")])


# -- leave-one-out -----------------------------------------------------------------------------


def test_leave_one_out_is_exact_when_the_model_is():
    results = leave_one_out(synthetic())
    assert list(results) == ["config0", "config1", "config2", "config3"]
    for held in results.values():
        assert len(held.errors_pct) == 3
        assert max(abs(e) for e in held.errors_pct) < 1e-5  # rounding of bytes only
        assert held.calibration.constant_bytes == TRUE_CONSTANT


def test_leave_one_out_holds_out_the_whole_group():
    # config4 measures 1.3x the true model: the fit without it predicts it 1/1.3 too low, and
    # every fit that includes it misses the held-out clean group
    samples = [
        s._replace(measured_bytes=1.3 * s.measured_bytes) if s.group == "config4" else s
        for s in synthetic(num_groups=5, ranks=2)
    ]
    results = leave_one_out(samples)
    for error in results["config4"].errors_pct:
        assert error == pytest.approx(100 * (1 / 1.3 - 1), abs=1e-4)
    for group in ("config0", "config1", "config2", "config3"):
        assert max(abs(e) for e in results[group].errors_pct) > 0.1
    with pytest.raises(InputError, match="at least 2 configurations"):
        leave_one_out(synthetic(num_groups=1))


# -- the file ----------------------------------------------------------------------------------


def test_file_round_trip(tmp_path):
    calibration = fit_calibration(synthetic())
    path = tmp_path / "calibration.json"
    write_calibration(path, calibration)
    loaded = load_calibration(path)
    assert loaded == calibration and loaded.meta == json.loads(json.dumps(calibration.meta))
    with pytest.raises(InputError, match="already exists; pass --force"):
        write_calibration(path, calibration)
    write_calibration(path, Calibration(constant_bytes=1), force=True)
    assert load_calibration(path).constant_bytes == 1


def valid_document() -> dict:
    return Calibration(scales={"weights": 1.2}, constant_bytes=100).to_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["scales"].update(weight=1.0), "unknown component(s) weight; valid: weights"),
        (lambda d: d["scales"].update(activations=-0.5), "scales.activations: -0.5 must be"),
        (
            lambda d: d["scales"].update(buffers=float("inf")),
            "scales.buffers: inf is not a finite number",
        ),
        (lambda d: d["scales"].update(grads="1.0"), "scales.grads: '1.0' must be a finite"),
        (lambda d: d.update(constant_bytes=1.5), "constant_bytes: 1.5 must be an integer"),
        (lambda d: d.update(constant_bytes="100"), "constant_bytes: '100' must be an integer"),
        (lambda d: d.pop("constant_bytes"), "missing field(s) constant_bytes"),
        (lambda d: d.update(scale={}), "unknown field(s) scale; remove them"),
        (lambda d: d.update(scales=[1.0]), "scales must be an object"),
        (lambda d: d.update(format="plan"), "not a calibration file"),
        (lambda d: d.update(version=2), "version 2 is not supported"),
    ],
)
def test_load_errors_name_the_file_and_the_field(tmp_path, edit, message):
    document = valid_document()
    edit(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(InputError) as caught:
        load_calibration(path)
    text = str(caught.value)
    assert message in text and str(path) in text and "\n" not in text


def test_load_errors_for_a_missing_file_and_bad_json(write_json, tmp_path):
    with pytest.raises(InputError, match="calibration file not found; write one with"):
        load_calibration(tmp_path / "absent.json")
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(InputError, match=r"broken.json: not valid JSON \(line 1"):
        load_calibration(path)
    assert load_calibration(
        write_json("calibration.json", {**valid_document(), "constant_bytes": 1e6})
    )


# -- solver CLIs -------------------------------------------------------------------------------

PLAN_ARGS = [GPT_1_3B, "--gpus", "8", "--global-batch", "16", "--time-limit", "20"]
EVALUATE_ARGS = [GPT_1_3B, "--pp", "2", "--global-batch", "16", "--split", "even"]


@pytest.mark.parametrize("main, args", [(plan_main, PLAN_ARGS), (evaluate_main, EVALUATE_ARGS)])
def test_cli_reports_the_calibration(write_json, tmp_path, capsys, main, args):
    calibration_path = write_json("calibration.json", valid_document())
    out = tmp_path / "result.json"
    assert main([*args, "--calibration", calibration_path, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibration: weights x1.2, grads x1, " in text and "constant +100 B per GPU" in text
    document = json.loads(out.read_text())
    assert document["calibration"] == {
        "scales": {name: 1.2 if name == "weights" else 1.0 for name in COMPONENTS},
        "constant_bytes": 100,
    }
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["calibration"] is None
    assert "calibration:" not in capsys.readouterr().out
    # --json may not overwrite the calibration it read
    assert main([*args, "--calibration", calibration_path, "--json", calibration_path]) == 2


@pytest.mark.parametrize("main, args", [(plan_main, PLAN_ARGS), (evaluate_main, EVALUATE_ARGS)])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "calibration file not found"),
        ("[1, 2", "not valid JSON"),
        (
            '{"format": "memplan-calibration", "version": 1, "scales": {"weights": -1}, '
            '"constant_bytes": 0}',
            "scales.weights: -1 must be a finite number in [0.01, 100]",
        ),
    ],
    ids=["missing", "not-json", "negative-scale"],
)
def test_cli_rejects_a_bad_calibration_file_in_one_line(
    tmp_path, capsys, main, args, content, message
):
    path = tmp_path / "calibration.json"
    if content is not None:
        path.write_text(content)
    assert main([*args, "--calibration", str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and str(path) in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == ""


def test_a_negative_constant_may_take_only_what_is_not_model_state(write_json, tmp_path, run_cli):
    """A constant of -2^40 (within the file's range) would make the peak negative: exit 2 naming
    the file, the field and the least constant this stage admits; that constant is accepted and
    leaves the stage exactly its model states, one byte less is refused; plan says the same and
    never "fits"."""
    path = write_json("calibration.json", {**valid_document(), "constant_bytes": -(2**40)})
    code, out, err = run_cli(evaluate_main, *EVALUATE_ARGS, "--calibration", path)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {path}: constant_bytes -1099511627776 takes stage ")
    assert "below its" in err and "of model states; here it must be >= " in err
    least = int(re.search(r"must be >= (-\d+) ", err)[1])
    assert -(2**40) < least < 0
    out_json = tmp_path / "result.json"
    exact = write_json("exact.json", {**valid_document(), "constant_bytes": least})
    code, out, err = run_cli(
        evaluate_main, *EVALUATE_ARGS, "--calibration", exact, "--json", str(out_json)
    )
    assert code == 0 and err == "" and "fits" in out
    stages = json.loads(out_json.read_text())["stages"]
    states = [sum(s["breakdown"][key] for key in ("weights", "grads", "optimizer")) for s in stages]
    assert all(stage["breakdown"]["constant"] == least for stage in stages)
    assert any(s["peak_bytes"] == held for s, held in zip(stages, states, strict=True))
    assert all(s["peak_bytes"] >= held for s, held in zip(stages, states, strict=True))
    below = write_json("below.json", {**valid_document(), "constant_bytes": least - 1})
    code, out, err = run_cli(evaluate_main, *EVALUATE_ARGS, "--calibration", below)
    assert code == 2 and f"here it must be >= {least} " in err
    code, out, err = run_cli(plan_main, *PLAN_ARGS, "--calibration", path)
    assert code == 2 and "fits" not in out and err.count("\n") == 1
    assert f"error: {path}: constant_bytes -1099511627776 takes stage " in err


def test_the_api_refuses_a_calibration_that_empties_a_stage():
    """The same guard for Python callers (no file: the message says "calibration")."""
    from solver import ParallelConfig, evaluate, load_graph

    graph = load_graph(GPT_1_3B)
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    training = TrainingConfig(global_batch=4, calibration=Calibration(constant_bytes=-(2**40)))
    with pytest.raises(InputError, match=r"^calibration: constant_bytes -1099511627776 takes"):
        evaluate(graph, config, "even", training=training)
    for scales in ({"weights": 0.0}, {"activations": -1.0}, {"grads": 101.0}):
        with pytest.raises(InputError, match=r"must be a finite number in \[0.01, 100\]"):
            Calibration(scales=scales)


@pytest.mark.slow
def test_cli_bad_calibration_from_a_subprocess_has_no_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "solver.plan",
            *PLAN_ARGS,
            "--calibration",
            str(tmp_path / "absent.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "calibration file not found" in done.stderr


# -- python -m profiling.calibrate -------------------------------------------------------------


def tiny_args(out) -> list[str]:
    return ["--model", "gpt-tiny", *(f"--set={k}={v}" for k, v in TINY.items()), "--out", str(out)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--configs", "9"], "--configs 9: at most 4"),
        (["--configs", "0"], "must be >= 1"),
        (["--timeout", "0"], "argument --timeout: must be a number in (0, 604800] seconds"),
        (["--timeout", "inf"], "argument --timeout: must be a number in (0, 604800] seconds"),
        (["--set", "layers"], "write FIELD=VALUE"),
        (["--iterations", "x"], "expected a positive integer"),
    ],
)
def test_calibrate_cli_bad_flags_exit_2_in_one_line(tmp_path, run_cli, extra, message):
    code, _, err = run_cli(calibrate_cli.main, *tiny_args(tmp_path / "c.json"), *extra)
    assert code == 2
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()


def test_calibrate_cli_unknown_model_and_missing_folder(tmp_path, capsys):
    assert calibrate_cli.main(["--model", "no-such-model", "--out", str(tmp_path / "c.json")]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert calibrate_cli.main(tiny_args(tmp_path / "absent" / "c.json")) == 2
    assert "does not exist; create it first" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ([], "no configurations given"),
        ([("pp2", 2)], "give (label, num_gpus, pins, global_batch"),
        ([("sp2", 2, {"sp": 2}, 8, 2, "1f1b")], "may only pin pp, dp and tp"),
        ([calibrate_cli.LAYOUTS[0], calibrate_cli.LAYOUTS[0]], "labels must be unique"),
    ],
)
def test_calibrate_api_rejects_bad_configurations_before_running(configs, message):
    with pytest.raises(InputError) as caught:
        calibrate_cli.calibrate("gpt-tiny", TINY, configs)
    assert message in str(caught.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_calibrate_end_to_end_on_two_configurations(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    assert calibrate_cli.main([*tiny_args(out), "--configs", "2"]) == 0
    printed = capsys.readouterr().out
    calibration = load_calibration(out)
    meta = calibration.meta
    assert [c["label"] for c in meta["configs"]] == ["pp2 1f1b m4", "pp2 gpipe m4"]
    rows = meta["samples"]
    assert [(r["config"], r["rank"], r["stage"]) for r in rows] == [
        ("pp2 1f1b m4", 0, 0),
        ("pp2 1f1b m4", 1, 1),
        ("pp2 gpipe m4", 0, 0),
        ("pp2 gpipe m4", 1, 1),
    ]
    # the analytic side: the same plans, made again, predict the same breakdowns
    graph = export_graph("gpt-tiny", dtype="fp32", overrides=TINY)
    for layout in calibrate_cli.LAYOUTS[:2]:
        again = plan_to_dict(
            plan(
                graph,
                Cluster(num_gpus=layout.num_gpus, gpus_per_node=layout.num_gpus),
                TrainingConfig(
                    global_batch=layout.global_batch,
                    micro_batch_sizes=(layout.micro_batch,),
                    schedule=layout.schedule,
                    runtime="torch",
                    max_slowdown=None,
                    tp=1,
                    **layout.pins,
                    **calibrate_cli.FP32_ADAM,
                ),
            )
        )
        mine = [r for r in rows if r["config"] == layout.label]
        assert [r["predicted_breakdown"] for r in mine] == [s["breakdown"] for s in again["stages"]]
    # the fit, the calibrated and leave-one-out predictions are recomputable from the samples
    samples = [Sample(r["predicted_breakdown"], r["measured_bytes"], r["config"]) for r in rows]
    assert fit_calibration(samples) == calibration
    held_out = leave_one_out(samples)
    for row in rows:
        assert row["measured_bytes"] > 0
        assert row["analytic_bytes"] == sum(row["predicted_breakdown"].values())
        assert row["calibrated_bytes"] == calibration.apply(row["predicted_breakdown"])
        assert row["loo_bytes"] == held_out[row["config"]].calibration.apply(
            row["predicted_breakdown"]
        )
        line = next(
            x
            for x in printed.splitlines()
            if x.startswith(row["config"])
            and x.split()[4:6] == [str(row["rank"]), str(row["stage"])]
        )
        for value in ("analytic_bytes", "calibrated_bytes", "measured_bytes"):
            assert f"{row[value] / 1024:.1f}" in line.split()
    loo = [abs(e) for held in held_out.values() for e in held.errors_pct]
    assert f"leave-one-out |error|: median {np.median(loo):.1f}%, max {max(loo):.1f}%" in printed
    # it does not overwrite the file without --force, and says so before running anything
    before = out.read_text()
    assert calibrate_cli.main([*tiny_args(out), "--configs", "2"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == before


@pytest.mark.slow
def test_interleaved_layout_plans_for_the_torch_runtime_with_chunks_in_the_split():
    layout = calibrate_cli.Layout("pp2 v2 m4", 2, {"pp": 2}, 8, 2, "1f1b", virtual_stages=2)
    training = layout.training()
    assert (training.virtual_stages, training.runtime) == ((2,), "torch")
    graph = export_graph("gpt-tiny", dtype="fp32", overrides=TINY)
    chosen = plan(graph, Cluster(num_gpus=2, gpus_per_node=2), training)
    split = calibrate_cli._split_text(chosen)  # layers per chunk, "+" within a rank
    assert [[int(n) for n in rank.split("+")] for rank in split.split("/")] == [
        [len(chunk) for chunk in stage.chunks] for stage in chosen.stages
    ]
    assert sum(int(n) for n in split.replace("+", "/").split("/")) == len(graph.names)
