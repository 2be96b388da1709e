"""``python -m solver.evaluate GRAPH.json --pp P ... --split 5,7,7,5``: see solver/cli.py."""

import sys

from solver.cli import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
