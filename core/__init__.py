"""Shared control plane of the SeamlessFlow testbed.

Pure Python (no torch, simpy or ray): capability/active tags, the five scheduling policies as
event-driven state machines, cluster and model specs, config loading, and the timeline record with
the one function that turns a timeline into metrics. Both executors (`sim/` and `reference/`) import
from here, so the simulator and the real runtime are scored and scheduled by the same code.
"""
