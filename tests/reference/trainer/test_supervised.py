"""The supervised warm start: it raises the likelihood of the generated tokens only, deterministically."""

from __future__ import annotations

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


@pytest.mark.parametrize("field, value, message", [("steps", 0, "steps must be an integer >= 1"),
                                                   ("lr", float("nan"), "lr must be a finite number"),
                                                   ("warmup_steps", -1, "must be >= 0")])  # fmt: skip
def test_bad_settings_name_themselves(field, value, message):
    with pytest.raises(ValueError, match=message):
        SupervisedConfig(**{field: value})


def test_nothing_to_learn_is_an_error(make_model):
    with pytest.raises(ValueError, match="generated tokens"):
        supervised_fit(make_model(0), [], SupervisedConfig(), 0)
