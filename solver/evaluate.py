"""``python -m solver.evaluate GRAPH.json --pp P ... --split 5,7,7,5``: see
solver/cli/evaluate.py.

Imported, this module calls :func:`solver.evaluation.evaluate` (``solver.evaluate`` is also the
API function; see solver/cli/entry.py)."""

from solver.cli.entry import make_callable
from solver.cli.evaluate import evaluate_main
from solver.console import run_main
from solver.evaluation import evaluate

make_callable(__name__, evaluate)

if __name__ == "__main__":
    run_main(evaluate_main)
