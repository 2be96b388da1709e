"""Searching for the plan: candidate configs and their bounds, quick incumbents, the exact
per-config solves, GPU counts, the Pareto front, and the planning API (``planner``)."""
