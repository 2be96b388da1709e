"""Showing a plan: JSON documents and text tables, plots, and the baselines it is compared with."""
