"""Every flag of every command line says what it does, and ``--help`` works: the solver CLIs
(solver.plan, solver.evaluate, solver.sweep) and the profiling ones (profiling.export,
profiling.calibrate; torch comes with the profiling extra the tests install)."""

from __future__ import annotations

import argparse
import importlib

import pytest

CLIS = {
    "solver.plan": ("solver.cli.plan", "plan_parser", "plan_main"),
    "solver.evaluate": ("solver.cli.evaluate", "evaluate_parser", "evaluate_main"),
    "solver.sweep": ("solver.cli.sweep", "sweep_parser", "sweep_main"),
    "profiling.export": ("profiling.export", "parser", "main"),
    "profiling.calibrate": ("profiling.calibrate", "parser", "main"),
}


def cli_function(cli: str, which: int):
    module, *names = CLIS[cli]
    return getattr(importlib.import_module(module), names[which])


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_every_flag_has_a_help_string(cli):
    parser = cli_function(cli, 0)()
    missing = [
        action.option_strings[0] if action.option_strings else action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        and not (action.help and action.help.strip())
    ]
    assert not missing, f"python -m {cli}: no help for {', '.join(missing)}"


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_help_exits_0(cli, capsys):
    with pytest.raises(SystemExit) as exited:
        cli_function(cli, 1)(["--help"])
    assert exited.value.code == 0
    assert f"python -m {cli}" in capsys.readouterr().out


def plot_help(cli: str) -> str:
    parser = cli_function(cli, 0)()
    (action,) = [a for a in parser._actions if "--plot" in a.option_strings]
    return action.help


def test_plot_help_names_only_the_cli_own_flags():
    assert "--pareto" in plot_help("solver.plan")
    assert "--pareto" not in plot_help("solver.evaluate")
    assert "even split" in plot_help("solver.evaluate")
