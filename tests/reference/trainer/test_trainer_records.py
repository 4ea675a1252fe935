"""Advantages, the trajectory record, collation, sharding and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from reference.trainer.advantages import group_advantages
from reference.trainer.batch import Trajectory, collate, shard_by_group
from reference.trainer.config import TrainerConfig
from reference.trainer.recipe import MathRecipe


def test_advantages_are_centred_and_scaled_within_each_group():
    rewards, groups = [1.0, 0.0, 0.5, 2.0, 4.0], ["a", "a", "a", "b", "b"]
    adv = group_advantages(rewards, groups, normalize_std=True, eps=1e-6)
    std_a = math.sqrt(((0.5) ** 2 + (0.5) ** 2 + 0) / 3)
    assert adv == pytest.approx([0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6), 0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6)])


def test_advantages_without_std_are_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0, 3.0, 5.0], [0, 0, 1, 1], normalize_std=False) == [0.5, -0.5, -1.0, 1.0]


def test_negative_weight_scales_only_the_advantages_below_zero():
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0], ["a", "a", "a", "a", "b", "b"]
    assert group_advantages(rewards, groups, normalize_std=False, negative_weight=0.0) == [0.75, 0, 0, 0, 0, 0]
    half = group_advantages(rewards, groups, normalize_std=False, negative_weight=0.5)
    assert half == pytest.approx([0.75, -0.125, -0.125, -0.125, 0.0, 0.0])
    with pytest.raises(ValueError, match="negative_weight must be in \\[0, 1\\], got 1.5"):
        group_advantages(rewards, groups, negative_weight=1.5)


def test_a_group_with_equal_rewards_or_one_member_gets_exactly_zero():
    adv = group_advantages([0.3, 0.3, 0.3, 7.0], ["g", "g", "g", "lonely"], normalize_std=True, eps=1e-12)
    assert adv == [0.0, 0.0, 0.0, 0.0]


def test_advantages_refuse_mismatched_inputs():
    with pytest.raises(ValueError, match="2 rewards for 1 group ids"):
        group_advantages([1.0, 2.0], ["g"])


def test_trajectory_checks_its_fields():
    with pytest.raises(ValueError, match="generated_mask has 2 entries for 3 tokens"):
        Trajectory((1, 2, 3), (0, 1), (-1.0,), (0,), "g", 1.0)
    with pytest.raises(ValueError, match="generated_mask\\[0\\] must be 0"):
        Trajectory((1, 2), (1, 1), (-1.0, -1.0), (0, 0), "g", 1.0)
    with pytest.raises(ValueError, match="2 generated tokens need as many logprobs and versions"):
        Trajectory((1, 2, 3), (0, 1, 1), (-1.0,), (0, 0), "g", 1.0)
    with pytest.raises(ValueError, match="reward must be a finite number"):
        Trajectory((1, 2), (0, 1), (-1.0,), (0,), "g", math.nan)


def test_from_export_drops_the_nulls_of_prompt_tokens():
    record = {"session_id": "s", "branch_id": 0, "token_ids": [4, 5, 6, 7, 8], "generated_mask": [0, 1, 0, 1, 1],
              "logprobs": [None, -0.5, None, -1.5, -2.5], "versions": [None, 3, None, 4, 4], "reward": 1,
              "task_id": "t7"}  # fmt: skip
    t = Trajectory.from_export(record)
    assert (t.logprobs, t.versions, t.group_id, t.reward) == ((-0.5, -1.5, -2.5), (3, 4, 4), "t7", 1.0)


def test_collate_aligns_everything_on_targets_and_pads_right():
    a = Trajectory((1, 2, 3, 4), (0, 1, 0, 1), (-0.1, -0.4), (2, 3), "g", 1.0)
    b = Trajectory((5, 6), (0, 1), (-0.7,), (1,), "g", 0.0)
    batch = collate([a, b], [0.5, -0.5], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor([[-0.1, 0, -0.4], [-0.7, 0, 0]]))
    assert batch.versions.tolist() == [[2, -1, 3], [1, -1, -1]]
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.num_tokens == 3


def test_collate_omits_the_attention_mask_when_nothing_is_padded():
    a = Trajectory((1, 2), (0, 1), (-0.1,), (0,), "g", 1.0)
    assert collate([a, a], [0.0, 0.0], pad_id=0).attention_mask is None
    assert collate([a], [0.0], pad_id=0).input_ids.dtype == torch.long


def test_shard_by_group_keeps_groups_whole_and_covers_the_batch():
    trajs = [Trajectory((1, 2), (0, 1), (-1.0,), (0,), g, 0.0) for g in "aabbbcdd"]
    shards = [shard_by_group(trajs, r, 2) for r in range(2)]
    assert [[t.group_id for t in s] for s in shards] == [list("aac"), list("bbbdd")]
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        shard_by_group(trajs, 2, 2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("clip_eps", 0.0, "clip_eps must be in \\(0, 1\\), got 0.0"),
        ("clip_eps_high", 1.5, "clip_eps_high must be in \\(0, 1\\) or null, got 1.5"),
        ("ratio_cap", 1.1, "ratio_cap must be > 1 \\+ clip_eps"),
        ("entropy_coef", -0.1, "entropy_coef must be >= 0"),
        ("lr", math.nan, "lr must be a finite number, got nan"),
        ("micro_batch_size", 0, "micro_batch_size must be an integer >= 1, got 0"),
        ("logit_chunk_tokens", 0, "logit_chunk_tokens must be an integer >= 1, got 0"),
        ("negative_weight", -0.5, "negative_weight must be in \\[0, 1\\], got -0.5"),
        ("warmup_steps", -1, "warmup_steps must be an integer >= 0 \\(0: no warm-up\\), got -1"),
        ("betas", (0.9, 1.0), "betas must be two values in \\[0, 1\\)"),
    ],
)
def test_trainer_config_names_the_bad_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**{field: value})


def test_the_default_advantages_are_the_recipes_group_centred_ones():
    """TrainerConfig's default is what the runtime's recipes use (Dr. GRPO: not divided by the group's std)."""
    from core.config import load_yaml
    from reference.control.config import DEFAULT_CONFIG

    assert TrainerConfig().normalize_std is False
    assert load_yaml(DEFAULT_CONFIG)["trainer"]["normalize_std"] is TrainerConfig().normalize_std
    assert MathRecipe().trainer.normalize_std is TrainerConfig().normalize_std


def test_trainer_config_round_trips_through_a_dict():
    config = TrainerConfig(lr=1e-3, betas=[0.8, 0.9])
    assert TrainerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown TrainerConfig field\\(s\\) \\['learning_rate'\\]"):
        TrainerConfig.from_dict({"learning_rate": 1.0})


def test_recipe_validates_and_builds_its_model_config():
    recipe = MathRecipe()
    config = recipe.model_config(22)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (128, 2, 22)
    assert recipe.batch_size == 256
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) must divide num_heads \\(4\\)"):
        MathRecipe(num_kv_heads=3)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        MathRecipe(group_size=1)
