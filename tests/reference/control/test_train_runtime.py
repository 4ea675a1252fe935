"""The runtime trains under each policy, end to end: Ray workers, engines, the trajectory manager, the rollout
manager, the trainer shards and `core.driver` (a few small steps each).

What every run must show: it finishes its steps; each trained token's policy-version lag respects the
policy (0 for the strictly on-policy ones, at most `max_staleness` otherwise); every group a step consumed
is marked once in the store and none twice; the stored tokens are exactly what the engines reported; and
the timeline tiles the wall time (the simulator's scorer accepts it).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from core.metrics import summarize
from reference.consistency import check_store
from reference.control.config import load_train_config
from reference.manager.store import TrajectoryStore
from reference.model import load_checkpoint
from reference.trainer.handoff import version_dir

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

SMALL = ["policy.num_steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4", "run.eval_every_steps=0",
         "rollout.max_concurrency=32", "engine.max_batch=32", "run.time_limit_s=300"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local Ray for the module, offering the capability tags."""
    ray.init(num_cpus=2, resources={"rollout": 4, "train": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(tmp_path: Path, policy: str, *extra: str, progress: bool = False):
    from reference.control.report import write_outputs
    from reference.train import train

    cfg = load_train_config(None, [*SMALL, f"policy.name={policy}", *extra])
    out = tmp_path / policy
    timeline, metrics = train(cfg, out, progress=progress)
    summary = write_outputs(timeline, metrics, {}, out, picture=False)
    return cfg, out, timeline, metrics, summary


@pytest.mark.parametrize(
    "policy, bound", [("colocated", 0), ("disaggregated", 0), ("async", 1), ("tag", 1), ("streaming", 1)]
)
def test_each_policy_trains_within_its_staleness_bound(tmp_path, policy, bound):
    cfg, out, timeline, metrics, summary = run(tmp_path, policy)
    assert [s["step"] for s in metrics.steps] == [0, 1, 2]
    lags = {int(lag) for lag in summary["staleness"]["histogram"]}
    assert lags, "no trained token was counted"
    assert max(lags) <= bound, f"{policy}: lags {sorted(lags)} exceed {bound}"
    assert summary["token_throughput"] > 0
    assert len(timeline.steps) == 3
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        consumed = store.consumed()
        assert len(consumed) == 3 * cfg.rollout.prompts_per_step  # every step's groups, each once
        assert sorted(set(consumed.values())) == [0, 1, 2]
        model, tok = load_checkpoint(version_dir(out / "weights", 0))
        report = check_store(store, model, tok, version=0)
    assert report.token_mismatches == 0
    assert report.requests > 0
    assert report.max_logprob_diff < 1e-3  # version-0 tokens re-score under the version-0 weights


def test_a_run_at_temperature_07_trains_on_the_log_probs_of_what_was_sampled(tmp_path):
    """The engines sample at 0.7 and store the log-probs of softmax(logits / 0.7); the trainers score at the same
    temperature, so on fresh tokens (strictly on-policy here) engine and trainer agree to fp32 rounding."""
    cfg, out, _, metrics, _ = run(tmp_path, "colocated", "policy.num_steps=2", "rollout.temperature=0.7")
    assert [s["step"] for s in metrics.steps] == [0, 1]
    assert all(s["fresh_tokens"] > 0 for s in metrics.steps)
    assert max(abs(s["fresh_mismatch_mean"]) for s in metrics.steps) < 1e-4, metrics.steps
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        model, tok = load_checkpoint(version_dir(out / "weights", 0))
        report = check_store(store, model, tok, version=0, temperature=cfg.rollout.temperature)
    assert report.scored_tokens > 0
    assert report.max_logprob_diff < 1e-3


def test_outputs_match_the_simulators(tmp_path, capsys):
    """The same files as `python -m sim`, plus metrics.jsonl and reward.png; the timeline reads back. With stderr
    not a terminal, a line a step; with a TensorBoard log, its event files hold each step."""
    from core.run_log import ScalarLog, read_scalars
    from core.timeline import Timeline
    from reference.control.report import logging_to, write_outputs

    board = ScalarLog(tmp_path / "tb") if importlib.util.find_spec("tensorboardX") else None
    with logging_to(board):
        cfg, out, timeline, metrics, _ = run(tmp_path, "tag", "policy.num_steps=2", progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 1/2", "step 2/2"]
    assert all(re.fullmatch(r"step \d/2  reward [\d.]+  [\d,]+ gen tok/s  staleness [\d.]+  \d+ s", x) for x in lines)
    if board is not None:
        assert [step for step, _ in read_scalars(tmp_path / "tb")["train/reward_mean"]] == [1, 2]
    write_outputs(timeline, metrics, {"policy": {"name": "tag"}}, out, picture=True)
    for name in ("summary.json", "intervals.json", "timeline.json", "timeline.png", "reward.png", "metrics.jsonl"):
        assert (out / name).is_file(), name
    again = Timeline.load(out / "intervals.json")
    assert summarize(again) == summarize(timeline)
    kinds = [line.split('"kind": "')[1].split('"')[0] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["held_out", "step", "step", "held_out"]
    # the end-of-run evaluation is of the final weights, on every engine (tag leaves its engines a version behind)
    end = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["label"] == "end" and end["engine_versions"] == [2], end


def test_a_run_without_evaluations_trains_and_evaluates_nothing(tmp_path):
    """`run.evaluate: false` (a run that measures throughput): no held-out evaluation before, during or after."""
    cfg, out, _, metrics, summary = run(tmp_path, "async", "policy.num_steps=2", "run.evaluate=false",
                                        "run.eval_every_steps=1")  # fmt: skip
    kinds = [line.split('"kind": "')[1].split('"')[0] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["step", "step"]
    assert metrics.evaluations == []
    assert summary["training"]["held_out_first"] is None and summary["token_throughput"] > 0


def _engine_pids(out: Path) -> list[int]:
    """Engine processes serving this run (their command line names the run's weights)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "reference engine" in cmd and str(out) in cmd:
                pids.append(int(proc.name))
    return pids


def test_a_killed_engine_is_routed_around_and_restarted(tmp_path, wait_for):
    """SIGKILL one engine mid-run: its requests continue elsewhere, the supervisor restarts it through its
    worker, and the run finishes every step with every group trained once."""
    import os
    import signal
    import threading

    out = tmp_path / "tag"
    killed, restarted, before = [], [], []

    def killer():
        wait_for(lambda: (out / "metrics.jsonl").is_file() and '"step"' in (out / "metrics.jsonl").read_text(),
                 timeout_s=240, what="the first step")  # fmt: skip
        before.extend(_engine_pids(out))
        pid = sorted(_engine_pids(out))[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        replaced = wait_for(lambda: [p for p in _engine_pids(out) if p != pid and p not in before], timeout_s=120,
                            what="a restarted engine")  # fmt: skip
        restarted.extend(replaced)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    steps = 60  # enough for the supervisor to notice the death (2 s probes) and start a new engine
    cfg, out, timeline, metrics, summary = run(tmp_path, "tag", f"policy.num_steps={steps}")
    thread.join(10)
    assert killed, "no engine was killed"
    assert restarted, "the killed engine was not restarted"
    assert [s["step"] for s in metrics.steps] == list(range(steps))
    assert timeline.counters["engine_restarts"] >= 1
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        assert len(store.consumed()) == steps * cfg.rollout.prompts_per_step


def _stepped(out: Path, n: int) -> bool:
    path = out / "metrics.jsonl"
    return path.is_file() and path.read_text().count('"kind": "step"') >= n


def _trainer_pid(out: Path) -> int:
    """The tag layout's trainer (T00) is the second worker: the parent of the engine started with seed 1."""
    for pid in _engine_pids(out):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if json.loads(cmd[cmd.index(b"--spec-json") + 1])["seed"] == 1:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise AssertionError("no trainer worker found")


def test_a_killed_trainer_resumes_from_its_checkpoint_with_no_group_lost_or_trained_twice(tmp_path, wait_for):
    import os
    import signal
    import threading

    from reference.train import train

    cfg = load_train_config(None, [*SMALL, "policy.name=tag", "policy.num_steps=8", "run.checkpoint_every_steps=2"])
    out = tmp_path / "run"

    def killer():
        wait_for(lambda: _stepped(out, 3), timeout_s=240, what="three steps")
        os.kill(_trainer_pid(out), signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    # The run stops with an error naming the decision that failed (the step, or whatever the dead worker's
    # engine was doing when it went).
    with pytest.raises(Exception, match=r"(StartTrain|Preempt|SwitchTag|SyncWeights)\("):
        train(cfg, out, progress=False)
    thread.join(10)
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        before = store.consumed()
    checkpoint = max(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*"))
    assert checkpoint >= 2
    timeline, metrics = train(cfg, out, progress=False, resume=True)
    assert [s["step"] for s in metrics.steps] == list(range(checkpoint, 8))
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        after = store.consumed()
    assert len(after) == 8 * cfg.rollout.prompts_per_step  # every step trained one batch; a repeat would raise
    assert sorted(after.values()) == sorted(step for step in range(8) for _ in range(cfg.rollout.prompts_per_step))
    kept = {k for k, step in before.items() if step < checkpoint}
    assert {k: after[k] for k in kept} == {k: before[k] for k in kept}  # steps before the checkpoint stand
    released = set(before) - kept
    assert released <= set(after)  # groups of the lost steps were trained again, not lost


def test_fsdp_in_bf16_with_checkpointing_and_a_kl_reference_trains(tmp_path):
    """The GPU recipe's trainer settings on CPU: FSDP over the train shards, bf16 compute with fp32 masters,
    recomputed activations, a sharded KL reference; the held-out evaluation runs on every shard (colocated:
    both resources train, so the model is sharded over two)."""
    extra = ["policy.num_steps=2", "trainer.kl_coef=0.01", "run.eval_every_steps=1", "trainer_parallel.fsdp=true",
             "trainer_parallel.param_dtype=bfloat16", "trainer_parallel.activation_checkpointing=true"]  # fmt: skip
    cfg, out, timeline, metrics, summary = run(tmp_path, "colocated", *extra)
    assert [s["step"] for s in metrics.steps] == [0, 1]
    assert all(s["kl"] >= 0 and s["grad_norm"] > 0 for s in metrics.steps)
    for s in metrics.steps:  # the trainer's own figures reach metrics.jsonl; trained tokens are generated ones
        assert {"fresh_mismatch_mean", "is_weight_mean", "dropped_groups", "ratio_mean"} <= s.keys()
        assert 0 < s["trained_tokens"] <= s["generated_tokens"]
    assert any(e["step"] == 1 and "eval_s" in e for e in metrics.evaluations)  # mid-run, by the shards
    model, _ = load_checkpoint(version_dir(out / "weights", 2))
    assert all(p.dtype.is_floating_point and p.dtype == model.dtype for p in model.parameters())
    first, _ = load_checkpoint(version_dir(out / "weights", 0))
    assert any(not (a == b).all() for a, b in zip(model.parameters(), first.parameters(), strict=True))
