"""Placement on Ray: the only package that imports Ray. Resource workers become actors placed by their
capability tags (Ray custom resources `rollout` and `train`)."""
