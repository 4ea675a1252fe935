"""The shipped suite's SWE workload for the simulator, and a task run's workload bounded by its limits.

`SUITE_WORKLOAD` is the fit `python -m swebench_env.sim_workload --workdir DIR` made of the shipped suite (its
train split's demonstrations, see `swebench_env/sim_workload.py` for how a fit is made); `task_workload(config)`
gives the `workload` keys of a `swebench_env.training.SweTaskConfig`'s run. Kept apart from the measuring code,
which builds a `SweTask`, so that the task can ask for its workload without importing it back.
"""

from __future__ import annotations

# `python -m swebench_env.sim_workload --workdir DIR` on the 2-core development machine (other work running): 32
# episodes, all "finished"; commands and grading timed in local checkouts (LocalRunner, evaluate_locally), not in
# Docker sandboxes, whose exec and container start add to both (docs/swe.md: "Training on SWE tasks on GPUs").
SUITE_WORKLOAD: dict = {
    "kind": "swe",
    "turns": {"median": 8.0, "sigma": 0.0, "min": 8, "max": 8},
    "prompt_tokens": {"median": 767.4, "sigma": 0.047, "min": 717, "max": 851},
    "response_tokens": {"median": 82.7, "sigma": 0.412, "min": 50, "max": 391},
    "tool_output_tokens": {"median": 53.8, "sigma": 0.641, "min": 29, "max": 668},
    "tool_latency_s": {"median": 0.0423, "sigma": 1.532, "min": 0.00336, "max": 0.783},
    "test_run_s": {"median": 0.709, "sigma": 0.269, "min": 0.496, "max": 1.49},
}


def task_workload(config) -> dict:
    """The simulator's `workload` keys for a `swebench_env.training.SweTaskConfig`'s run: `SUITE_WORKLOAD`
    bounded by the task's limits (its turns, the tokens a call generates, its context). Merge over a
    simulator config; GRPO's group sizes come from the runtime's rollout section."""
    caps = {"turns": config.max_turns, "response_tokens": config.max_tokens, "prompt_tokens": config.context_tokens}
    out = {k: (_capped(v, caps[k]) if k in caps else v) for k, v in SUITE_WORKLOAD.items()}
    return {**out, "max_context_tokens": config.context_tokens}


def _capped(dist: dict, cap: int) -> dict:
    return {k: min(v, cap) if k in ("median", "min", "max") else v for k, v in dist.items()}
