"""Experiment scripts: one per figure, run as `python -m experiments.<name>`."""
