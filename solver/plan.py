"""``python -m solver.plan GRAPH.json --gpus N --global-batch B ...``: see solver/cli/plan.py.

Imported, this module calls :func:`solver.search.planner.plan` (``solver.plan`` is also the API
function; see solver/cli/entry.py)."""

from solver.cli.entry import make_callable
from solver.cli.plan import plan_main
from solver.console import run_main
from solver.search.planner import plan

make_callable(__name__, plan)

if __name__ == "__main__":
    run_main(plan_main)
