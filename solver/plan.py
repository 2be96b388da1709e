"""``python -m solver.plan GRAPH.json --gpus N --global-batch B ...``: see solver/cli.py."""

import sys

from solver.cli import plan_main

if __name__ == "__main__":
    sys.exit(plan_main())
