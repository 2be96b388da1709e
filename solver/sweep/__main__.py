"""``python -m solver.sweep``: see solver/cli/sweep.py."""

from solver.cli.sweep import sweep_main

if __name__ == "__main__":
    raise SystemExit(sweep_main())
