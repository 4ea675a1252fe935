"""The SWE warm-start probe: its rendering is the manager's, token for token, and its SFT step learns."""

from __future__ import annotations

import pytest
import torch

from reference.model import build_model
from reference.tokenizer import default_tokenizer
from reference.trainer.swe_probe import ModelDims, sft_step
from reference.trainer.swe_probe_data import Recording, render_episode
from swebench_env.agent import AgentConfig
from swebench_env.runner import LocalResult
from swebench_env.scripted import demonstration_manager, replay_demonstration
from swebench_env.suite import load_suite, load_suite_demonstrations

INSTANCE = "swesuite__intervalset-3"  # its fix is a heredoc script: quotes and newlines inside the JSON call


class ReplayRunner:
    """A command runner that answers the demonstration's commands with fixed outputs, in order."""

    def __init__(self, outputs: list[tuple[int, str, bool]]) -> None:
        self.outputs = list(outputs)

    def exec(self, cmd: str, timeout_s: float, workdir: str | None = None) -> LocalResult:
        if not self.outputs:  # the agent reads the final diff after the episode
            return LocalResult(0, "", False)
        code, output, timed_out = self.outputs.pop(0)
        return LocalResult(code, output, timed_out)


@pytest.fixture(scope="module")
def task_and_demo():
    tasks, demos = load_suite("train"), load_suite_demonstrations("train")
    return next((t, d) for t, d in zip(tasks, demos, strict=True) if t.instance_id == INSTANCE)


@pytest.fixture(scope="module")
def recording(task_and_demo):
    """Made-up outputs (a failing command, a long output, a timeout, an empty output): rendering must not care."""
    steps = len(task_and_demo[1].steps) - 1
    outputs = [(0, f"output of step {k}\n", False) for k in range(steps)]
    outputs[1] = (1, 'Traceback (most recent call last):\n  File "<stdin>", line 4\nValueError: "x"\n', False)
    outputs[3] = (0, "".join(f"{n:6d}\t    line {n}\n" for n in range(1, 800)), False)
    outputs[4] = (0, "", False)
    outputs[5] = (-1, "partial", True)
    return Recording(tuple(outputs), fix_step=4, fix_diff="")


def test_rendering_is_what_the_manager_stores_for_the_agent(task_and_demo, recording):
    task, demo = task_and_demo
    tok = default_tokenizer()
    config = AgentConfig(max_turns=len(demo.steps) + 1, max_observation_chars=2000)
    with demonstration_manager([(task, demo)], tok) as m:
        replay_demonstration(task, demo, m.url, ReplayRunner(list(recording.outputs)), config, "probe")
        tree = m.call(m.manager.trajectory("probe"))
    (branch,) = tree["branches"]
    episode = render_episode(task, demo, recording, tok, config)
    assert list(episode.token_ids) == branch["token_ids"]
    assert list(episode.generated_mask) == branch["generated_mask"]
    assert len(episode.turns) == len(demo.steps)


@pytest.fixture
def one_thread():
    """One torch thread: on a busy 2-core machine two threads spin against each other (4-7x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_few_sft_steps_lower_the_loss(task_and_demo, recording, one_thread):
    tok = default_tokenizer()
    episode = render_episode(*task_and_demo, recording, tok)
    dims = ModelDims(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    model = build_model(dims.config(tok.vocab_size), seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [sft_step(model, optimizer, [episode], tok.pad_token_id) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.5


class ResolvesOnce:
    """A judge stub: only its `at`-th call (from 0) resolves, so the group judged around it has rewards that differ."""

    def __init__(self, at: int) -> None:
        self.at, self.commands = at, []

    def __call__(self, task, recording, command: str | None) -> bool:
        self.commands.append(command)
        return len(self.commands) == self.at + 1


def test_fix_turn_grpo_with_a_kl_anchor_and_the_sft_moments_trains_and_evaluates(task_and_demo, one_thread):
    from reference.trainer.config import TrainerConfig
    from reference.trainer.swe_probe import run_fix_grpo
    from reference.trainer.swe_probe_data import Data

    tok = default_tokenizer()
    steps = len(task_and_demo[1].steps) - 1
    short = Recording(tuple((0, "ok\n", False) for _ in range(steps)), fix_step=4, fix_diff="")
    episode = render_episode(*task_and_demo, short, tok)
    dims = ModelDims(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    model = build_model(dims.config(tok.vocab_size), seed=0).train()
    sft = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sft_step(model, sft, [episode], tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    judge, lines = ResolvesOnce(at=1), []  # call 0: the first evaluation; 1, 2: the group
    config = TrainerConfig(lr=1e-3, kl_coef=0.1, entropy_coef=0.0, normalize_std=False, warmup_steps=2)
    data = Data([(task_and_demo[0], short, episode)], [])
    history = run_fix_grpo(model, tok, data, judge, steps=1, tasks_per_step=1, group_size=2, trainer_config=config,
                           eval_every=1, samples=1, moments=sft.state_dict(), log=lines.append)  # fmt: skip
    assert [h["step"] for h in history] == [0, 1]
    assert history[1]["reward"] == 0.5  # one of the group's two samples resolved: advantages +-0.5
    assert len(judge.commands) == 1 + 2 + 1  # the first evaluation, the group of 2, the second evaluation
    assert all(0.0 <= h["proxy_train"] <= 1.0 for h in history)
    assert any((p.detach() - q).abs().max() > 0 for p, q in zip(model.parameters(), before, strict=True))
    assert len(lines) == 2


def test_samples_follow_the_temperature(one_thread):
    from reference.trainer.swe_probe_proxy import sample_completions

    tok = default_tokenizer()
    dims = ModelDims(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    model = build_model(dims.config(tok.vocab_size), seed=0).eval()
    prompt = tok.encode("Fix the bug.")

    def samples(temperature: float) -> list[tuple[int, ...]]:
        (group,) = sample_completions(model, [prompt], 3, tok.stop_token_ids, 6, seed=1, temperature=temperature)
        return [tuple(r.token_ids) for r in group]

    greedy = samples(0.0)
    assert len(set(greedy)) == 1 and len(greedy[0]) == 6  # one path: the argmax
    assert len(set(samples(1.0))) == 3  # a random model over the whole vocabulary: three different draws
