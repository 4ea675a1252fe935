"""The supervised warm start: it raises the likelihood of the generated tokens only, deterministically."""

from __future__ import annotations

import math

import pytest
import torch

from reference.trainer.batch import Trajectory, collate
from reference.trainer.supervised import SupervisedConfig, sequence_nll, supervised_fit


def _demo(prompt: list[int], reply: list[int]) -> Trajectory:
    return Trajectory(prompt + reply, [0] * len(prompt) + [1] * len(reply), [0.0] * len(reply), [0] * len(reply),
                      "demo", 0.0)  # fmt: skip


DEMOS = [_demo([1, 2, 3], [7, 8, 9, 10]), _demo([4, 5], [11, 12, 13]), _demo([1, 2, 3, 7, 8, 9, 10, 6], [14, 15])]


def _nll(model, trajectories) -> tuple[float, float]:
    """(mean NLL of generated tokens, mean NLL of prompt tokens after the first)."""
    batch = collate(trajectories, [0.0] * len(trajectories), 0)
    prompt_mask = (1 - batch.mask) * (batch.input_ids[:, 1:] != 0)
    with torch.no_grad():
        gen = sequence_nll(model, batch.input_ids, batch.attention_mask, batch.mask) / batch.mask.sum()
        ctx = sequence_nll(model, batch.input_ids, batch.attention_mask, prompt_mask) / prompt_mask.sum()
    return float(gen), float(ctx)


def test_the_warm_start_learns_the_replies_not_the_prompts(make_model):
    model = make_model(0)
    gen_before, ctx_before = _nll(model, DEMOS)
    records = supervised_fit(model, DEMOS, SupervisedConfig(steps=60, batch_size=3, lr=1e-2, warmup_steps=5), 0)
    gen_after, ctx_after = _nll(model, DEMOS)
    assert len(records) == 60
    assert records[-1]["loss"] < records[0]["loss"]
    assert gen_after < 0.25 * gen_before
    assert ctx_after > 0.5 * ctx_before  # prompts are context: not what is learned
    assert records[0]["tokens"] == sum(t.num_generated for t in DEMOS)


def test_the_same_records_and_seed_give_the_same_weights(make_model):
    config = SupervisedConfig(steps=5, batch_size=2, micro_batch_size=1, seed=3)
    a, b = make_model(0), make_model(0)
    supervised_fit(a, DEMOS, config, 0)
    supervised_fit(b, DEMOS, config, 0)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


BAD = [
    ("steps", 0, "steps must be an integer >= 1"),
    ("lr", float("nan"), "lr must be a finite number"),
    ("warmup_steps", -1, "must be >= 0"),
    ("decay", "linear", "decay must be one of none, cosine, got 'linear'"),
    ("final_lr_ratio", 1.5, r"final_lr_ratio must be a number in \[0, 1\]"),
    ("target_loss", 0.0, "target_loss must be a finite number > 0 or null, got 0.0"),
    ("target_loss", float("inf"), "target_loss must be a finite number > 0 or null, got inf"),
    ("target_loss", "0.02", "target_loss must be a finite number > 0 or null, got '0.02'"),
    ("target_window", 0, "target_window must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("field, value, message", BAD)
def test_bad_settings_name_themselves(field, value, message):
    with pytest.raises(ValueError, match=message):
        SupervisedConfig(**{field: value})


def test_nothing_to_learn_is_an_error(make_model):
    with pytest.raises(ValueError, match="generated tokens"):
        supervised_fit(make_model(0), [], SupervisedConfig(), 0)


def test_the_learning_rate_warms_up_then_stays_or_decays_to_its_final_share():
    constant = SupervisedConfig(steps=10, lr=1.0, warmup_steps=2)
    cosine = SupervisedConfig(steps=10, lr=1.0, warmup_steps=2, decay="cosine", final_lr_ratio=0.1)
    assert [constant.learning_rate(s) for s in range(10)] == [0.5] + [1.0] * 9
    rates = [cosine.learning_rate(s) for s in range(10)]
    assert rates[:3] == [0.5, 1.0, 1.0]  # the warm-up, then the decay starts from lr
    assert all(a > b for a, b in zip(rates[2:], rates[3:], strict=False))  # falls every step
    assert rates[-1] == pytest.approx(0.1)  # to final_lr_ratio * lr at the last step
    assert rates[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))


def test_a_cosine_warm_start_sets_the_optimiser_to_its_schedule(make_model):
    config = SupervisedConfig(steps=4, batch_size=2, lr=1e-2, warmup_steps=1, decay="cosine")
    seen = []
    model = make_model(0)
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        supervised_fit(model, DEMOS, config, 0)
    finally:
        torch.optim.AdamW.step = original
    assert seen == pytest.approx([config.learning_rate(s) for s in range(4)]) and seen[-1] == 0.0


def test_a_loss_target_stops_the_fit_at_the_first_window_whose_mean_reaches_it(make_model):
    full = supervised_fit(make_model(0), DEMOS, SupervisedConfig(steps=60, batch_size=3, lr=1e-2, warmup_steps=5), 0)
    losses = [r["loss"] for r in full]
    window = 5
    target = sum(losses[30 : 30 + window]) / window  # the window ending at step 35 reaches it (maybe earlier)
    first = next(n for n in range(window, 61) if sum(losses[n - window : n]) / window <= target)
    config = SupervisedConfig(steps=60, batch_size=3, lr=1e-2, warmup_steps=5, target_loss=target, target_window=window)
    stopped = supervised_fit(make_model(0), DEMOS, config, 0)
    assert len(stopped) == first <= 35
    assert [r["loss"] for r in stopped] == losses[:first]  # the same fit, cut short


def test_a_loss_target_never_stops_before_its_window_nor_without_being_reached():
    config = SupervisedConfig(target_loss=0.5, target_window=3)
    assert not config.reached_target([0.1, 0.1])  # fewer steps than the window
    assert config.reached_target([9.0, 0.5, 0.5, 0.5])  # the mean of the last 3
    assert not config.reached_target([0.1, 0.1, 1.4])  # mean 0.533
    assert not SupervisedConfig().reached_target([0.0] * 50)  # no target: the fit runs its steps


def test_the_run_s_warm_start_stops_at_its_target_and_records_numbers_only(tmp_path, make_model, task_tok):
    """`reference.control.warm_start.warm_start` with a loss target: it stops early, says so, publishes version 0,
    and every counter it adds is a number (the run's summary writes them as floats)."""
    import json
    from types import SimpleNamespace

    from reference.control.report import MetricsLog
    from reference.control.warm_start import warm_start
    from reference.trainer.handoff import publish_weights

    model = make_model(0)
    start = publish_weights(model.state_dict(), model.config, tmp_path / "init", 0, task_tok).path
    full = supervised_fit(make_model(0), DEMOS, SupervisedConfig(steps=60, batch_size=3, lr=1e-2, warmup_steps=5), 0)
    target = sum(r["loss"] for r in full[30:35]) / 5  # reached by step 35 at the latest
    section = {"steps": 60, "batch_size": 3, "lr": 1e-2, "warmup_steps": 5, "target_loss": target, "target_window": 5}
    cfg = SimpleNamespace(task=SimpleNamespace(name="demo"), warm_start=section)
    task = SimpleNamespace(demonstrations=lambda folder: DEMOS)
    metrics = MetricsLog(tmp_path / "out" / "metrics.jsonl")
    warm = warm_start(cfg, task, tmp_path / "out", str(start), metrics, progress=False)
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert 5 <= len(steps) <= 35 and all(s["kind"] == "warm_start" for s in steps)
    assert metrics.counters["warm_start_reached_target"] == 1.0
    assert metrics.counters["warm_start_loss_window"] <= target
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in metrics.counters.values()), metrics.counters
    assert (tmp_path / "out" / "weights").is_dir() and warm
