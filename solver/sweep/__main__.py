"""``python -m solver.sweep``: see solver/cli/sweep.py."""

from solver.cli.sweep import sweep_main
from solver.console import exit_process

if __name__ == "__main__":
    exit_process(sweep_main())
