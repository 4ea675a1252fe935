"""Rollout: prompt groups -> sessions of the trajectory manager -> graded, rewarded groups for the trainer."""
