"""Precision and optimizer as words (solver/precision.py): the table, the graph's default, the
--bytes-per-param override, and the CLI flags on plan and evaluate."""

from __future__ import annotations

import json

import pytest

from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from solver.errors import InputError
from solver.evaluation import evaluate
from solver.graph import load_graph
from solver.precision import OPTIMIZERS, PRECISIONS, bytes_per_param, for_graph, graph_precision
from solver.specs import ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B

TABLE = {
    # (precision, optimizer, runtime): (weights, grads, optimizer state), bytes per parameter
    ("fp32", "adam", "megatron"): (4, 4, 8),
    ("fp32", "adam", "torch"): (4, 4, 8),
    ("fp32", "adamw", "torch"): (4, 4, 8),
    ("fp32", "sgd", "torch"): (4, 4, 0),
    ("fp32", "sgd-momentum", "torch"): (4, 4, 4),
    ("fp32", "lion", "megatron"): (4, 4, 4),
    ("bf16", "adam", "torch"): (2, 2, 4),
    ("bf16", "sgd", "megatron"): (2, 2, 0),
    ("bf16-mixed", "adam", "megatron"): (2, 4, 12),
    ("bf16-mixed", "adam", "torch"): (2, 2, 12),
    ("bf16-mixed", "sgd", "megatron"): (2, 4, 4),
    ("bf16-mixed", "sgd-momentum", "torch"): (2, 2, 8),
    ("bf16-mixed", "lion", "megatron"): (2, 4, 8),
    ("fp16-mixed", "adam", "megatron"): (2, 2, 12),
    ("fp16-mixed", "adamw", "torch"): (2, 2, 12),
}
"""Megatron-LM bf16: 2 + 4 (fp32 main_grad) + 12 (fp32 master + 2 moments) = 18 bytes; fp16
keeps fp16 main_grad (only --bf16 sets accumulate_allreduce_grads_in_fp32); ZeRO paper mixed
Adam 2 + 2 + 12 = 16; fp32 Adam 16; pure bf16 Adam 8."""


@pytest.mark.parametrize(("words", "expected"), list(TABLE.items()))
def test_table(words, expected):
    assert bytes_per_param(*words) == expected
    precision, optimizer, runtime = words
    training = TrainingConfig(
        global_batch=1, precision=precision, optimizer=optimizer, runtime=runtime
    )
    assert (
        training.weight_bytes_per_param,
        training.grad_bytes_per_param,
        training.optimizer_bytes_per_param,
    ) == expected


def test_every_word_has_a_row():
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            for runtime in ("megatron", "torch"):
                w, g, o = bytes_per_param(precision, optimizer, runtime)
                assert w in (2, 4) and g in (2, 4) and o >= 0


def test_api_default_is_the_old_bytes():
    """TrainingConfig without words or bytes: bf16-mixed Adam, as before the words (2, 4, 12 on
    megatron, 2, 2, 12 on torch)."""
    megatron = TrainingConfig(global_batch=1)
    torch_ = TrainingConfig(global_batch=1, runtime="torch")
    assert (megatron.weight_bytes_per_param, megatron.grad_bytes_per_param) == (2, 4)
    assert megatron.optimizer_bytes_per_param == 12
    assert (torch_.weight_bytes_per_param, torch_.grad_bytes_per_param) == (2, 2)
    assert torch_.optimizer_bytes_per_param == 12


def test_given_bytes_win_over_the_table():
    training = TrainingConfig(global_batch=1, precision="fp32", weight_bytes_per_param=2)
    assert (training.weight_bytes_per_param, training.grad_bytes_per_param) == (2, 4)
    assert training.optimizer_bytes_per_param == 8
    assert training.bytes_from_table == {"grad_bytes_per_param", "optimizer_bytes_per_param"}


def _graph_with_dtype(tmp_path, dtype):
    document = json.loads(open(GPT_1_3B).read())
    document.setdefault("meta", {})["dtype"] = dtype
    path = tmp_path / f"gpt-1.3b-{dtype}.json"
    path.write_text(json.dumps(document))
    return str(path)


@pytest.mark.parametrize(
    ("dtype", "word"),
    [("fp32", "fp32"), ("bf16", "bf16-mixed"), ("fp16", "fp16-mixed"), ("float32", "fp32")],
)
def test_graph_dtype_gives_the_default(tmp_path, dtype, word):
    graph = load_graph(_graph_with_dtype(tmp_path, dtype))
    assert graph_precision(graph) == word
    resolved = for_graph(TrainingConfig(global_batch=1), graph)
    assert resolved.precision == word
    expected = bytes_per_param(word, "adam", "megatron")
    assert (
        resolved.weight_bytes_per_param,
        resolved.grad_bytes_per_param,
        resolved.optimizer_bytes_per_param,
    ) == expected


def test_for_graph_keeps_given_bytes_and_words(tmp_path):
    graph = load_graph(_graph_with_dtype(tmp_path, "fp32"))
    given = TrainingConfig(global_batch=1, weight_bytes_per_param=2)
    resolved = for_graph(given, graph)
    assert resolved.precision == "fp32"
    assert resolved.weight_bytes_per_param == 2  # given: kept
    assert (resolved.grad_bytes_per_param, resolved.optimizer_bytes_per_param) == (4, 8)
    chosen = TrainingConfig(global_batch=1, precision="bf16-mixed")
    assert for_graph(chosen, graph) is chosen


def test_unknown_graph_dtype_asks_for_precision(tmp_path):
    graph = load_graph(_graph_with_dtype(tmp_path, "fp8"))
    with pytest.raises(InputError, match="meta.dtype 'fp8'.*--precision"):
        graph_precision(graph)
    # a precision given: the graph's dtype is not needed
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    training = TrainingConfig(global_batch=4, micro_batch_sizes=(1,), precision="fp32")
    result = evaluate(graph, config, "even", training=training)
    assert result.training.weight_bytes_per_param == 4


def _evaluate_json(run_cli, tmp_path, graph, *flags):
    out = tmp_path / f"ev{len(list(tmp_path.iterdir()))}.json"
    code, stdout, err = run_cli(
        evaluate_main,
        graph,
        *("--pp", "4", "--tp", "2", "--global-batch", "64", "--split", "5,7,7,7"),
        *("--json", str(out), *flags),
    )
    assert code == 0, err
    return json.loads(out.read_text()), stdout


def test_evaluate_fp32_graph_uses_fp32_bytes(run_cli, tmp_path):
    """The fix of issue 15 item 6: evaluate without byte flags on an fp32 graph is fp32 Adam
    (4, 4, 8), not 2, 4, 12."""
    fp32 = _graph_with_dtype(tmp_path, "fp32")
    default, text = _evaluate_json(run_cli, tmp_path, fp32)
    explicit, _ = _evaluate_json(run_cli, tmp_path, fp32, "--bytes-per-param", "4,4,8")
    assert default["stages"] == explicit["stages"]
    assert default["training"]["precision"] == "fp32"
    assert "precision fp32, adam: 4+4+8 bytes/param" in text
    # the same split of the bf16 graph (2, 4, 12): weights x2, gradients equal, optimizer x2/3
    bf16, _ = _evaluate_json(run_cli, tmp_path, GPT_1_3B)
    for ours, theirs in zip(default["stages"], bf16["stages"], strict=True):
        mine, old = ours["breakdown"], theirs["breakdown"]
        assert mine["weights"] == pytest.approx(2 * old["weights"], abs=64)
        assert mine["grads"] == old["grads"]
        assert mine["optimizer"] == pytest.approx(old["optimizer"] * 8 / 12, abs=64)


def test_evaluate_bf16_graph_keeps_the_old_numbers(run_cli, tmp_path):
    """bf16 graphs: bf16-mixed Adam = 2, 4, 12 on megatron and 2, 2, 12 on torch, the bytes
    used before the words (the figures of docs and README stay)."""
    default, text = _evaluate_json(run_cli, tmp_path, GPT_1_3B)
    old, _ = _evaluate_json(run_cli, tmp_path, GPT_1_3B, "--bytes-per-param", "2,4,12")
    assert default["stages"] == old["stages"]
    assert default["peak_bytes"] == old["peak_bytes"]
    assert "precision bf16-mixed, adam: 2+4+12 bytes/param" in text
    torch_default, _ = _evaluate_json(run_cli, tmp_path, GPT_1_3B, "--runtime", "torch")
    torch_old, _ = _evaluate_json(
        run_cli, tmp_path, GPT_1_3B, "--runtime", "torch", "--bytes-per-param", "2,2,12"
    )
    assert torch_default["stages"] == torch_old["stages"]


def test_override_wins_and_the_report_says_so(run_cli, tmp_path):
    given, text = _evaluate_json(
        run_cli, tmp_path, GPT_1_3B, "--precision", "fp32", "--bytes-per-param", "2,2,4"
    )
    assert [given["training"][f"{k}_bytes_per_param"] for k in ("weight", "grad", "optimizer")] == [
        2,
        2,
        4,
    ]
    assert "2+2+4 bytes/param (--bytes-per-param; the table gives 4+4+8" in text


def test_optimizer_word_changes_the_optimizer_state(run_cli, tmp_path):
    adam, _ = _evaluate_json(run_cli, tmp_path, GPT_1_3B)
    sgd, text = _evaluate_json(run_cli, tmp_path, GPT_1_3B, "--optimizer", "sgd")
    # bf16-mixed SGD keeps only the fp32 master copy: 4 of Adam's 12 bytes
    for a, s in zip(adam["stages"], sgd["stages"], strict=True):
        assert s["breakdown"]["optimizer"] == pytest.approx(a["breakdown"]["optimizer"] / 3, 1e-6)
        assert s["breakdown"]["weights"] == a["breakdown"]["weights"]
    assert "precision bf16-mixed, sgd: 2+4+4 bytes/param" in text


def test_plan_records_the_words(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(
        plan_main,
        GPT_1_3B,
        *("--gpus", "8", "--global-batch", "64", "--precision", "fp32", "--optimizer", "adamw"),
        *("--json", str(out)),
    )
    assert code == 0, err
    training = json.loads(out.read_text())["training"]
    assert (training["precision"], training["optimizer"]) == ("fp32", "adamw")
    assert [training[f"{k}_bytes_per_param"] for k in ("weight", "grad", "optimizer")] == [4, 4, 8]
    assert "precision fp32, adamw: 4+4+8 bytes/param" in stdout
    code, again, err = run_cli(evaluate_main, "--plan", str(out))
    assert code == 0, err and "plan check" in again


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [("--precision", "fp8", "bf16-mixed"), ("--optimizer", "adagrad", "sgd-momentum")],
)
@pytest.mark.parametrize(
    ("main", "args"),
    [
        (plan_main, ("--gpus", "8", "--global-batch", "8")),
        (evaluate_main, ("--pp", "2", "--split", "even", "--global-batch", "8")),
    ],
)
def test_bad_word_exits_2_with_one_line(run_cli, main, args, flag, value, words):
    code, _, err = run_cli(main, GPT_1_3B, *args, flag, value)
    assert code == 2
    assert err.count("\n") == 1 and flag in err and repr(value) in err and words in err
