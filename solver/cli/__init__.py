"""The command lines: ``python -m solver.plan`` (:mod:`solver.cli.plan`), ``python -m
solver.evaluate`` (:mod:`solver.cli.evaluate`) and ``python -m solver.sweep``
(:mod:`solver.cli.sweep`), with what they share in :mod:`solver.cli.common`. Each only parses,
calls the API, prints and writes files."""

from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from solver.cli.sweep import sweep_main
from solver.console import OneLineErrorParser, positive_int, write_json

__all__ = [
    "OneLineErrorParser",
    "evaluate_main",
    "plan_main",
    "positive_int",
    "sweep_main",
    "write_json",
]
