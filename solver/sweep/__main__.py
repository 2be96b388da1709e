"""``python -m solver.sweep``: see solver/cli/sweep.py."""

from solver.cli.sweep import sweep_main
from solver.console import run_main

if __name__ == "__main__":
    run_main(sweep_main)
