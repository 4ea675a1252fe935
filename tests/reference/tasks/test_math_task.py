"""The math task: answers, grading, the held-out split, no constant shortcut, its tokenizer, the registry."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from reference.tasks import TASKS, make_task
from reference.tasks.base import Problem
from reference.tasks.math import MathConfig, MathTask
from reference.tasks.tokenizer import ALPHABET, char_tokenizer, task_tokenizer
from reference.tokenizer import ENDOFTEXT, IM_END, IM_START


@pytest.fixture(scope="module")
def task() -> MathTask:
    return make_task("math")


def test_answers_add_the_digit_to_every_column_modulo_10(task):
    assert task.problem("483", "1") == Problem("483+1", "483+1=", "594", ignore_eos=True)
    assert task.problem("979", "2").answer == "191"
    small = MathTask(digits=2, addends="7")
    assert small.problem("35", "7").answer == "02"
    assert len(small.held_out()) == 10  # half the 20 held-out prompts of a 100-prompt space


def test_problem_refuses_the_wrong_shape(task):
    with pytest.raises(ValueError, match="need a 3-digit A and B one of '12', got '48' and '1'"):
        task.problem("48", "1")
    with pytest.raises(ValueError, match="B one of '12'"):
        task.problem("483", "5")


def test_reward_is_the_fraction_of_positions_right(task):
    p = task.problem("483", "1")
    assert task.grade(p, "594").reward == 1.0
    assert task.grade(p, "594").exact
    assert task.grade(p, "590").reward == pytest.approx(2 / 3)
    assert not task.grade(p, "590").exact
    assert task.grade(p, "5").reward == pytest.approx(1 / 3)  # missing characters are wrong
    assert task.grade(p, "594<|im_end|>").exact  # characters after the answer are ignored
    assert task.grade(p, "").reward == 0.0


def test_no_constant_answer_beats_chance_over_the_whole_prompt_space(task):
    problems = [task.problem("".join(a), b) for a in itertools.product("0123456789", repeat=3) for b in "12"]
    for constant in ("000", "594", "999", "123"):
        mean = sum(task.grade(p, constant).reward for p in problems) / len(problems)
        assert mean == pytest.approx(0.1)


def test_the_answer_depends_on_the_prompt(task):
    rng = random.Random(0)
    answers = {p.answer for p in task.sample_train(rng, 200)}
    assert len(answers) > 100


def test_training_never_sees_a_held_out_prompt(task):
    held = task.held_out()
    assert len(held) == 128
    assert len({p.prompt for p in held}) == 128
    assert all(task.is_held_out(p) for p in held)
    train = task.sample_train(random.Random(1), 2000)
    assert not any(task.is_held_out(p) for p in train)
    assert not {p.prompt for p in held} & {p.prompt for p in train}


def test_the_split_is_the_same_in_every_instance():
    assert MathTask().held_out() == MathTask().held_out()
    assert MathTask(split_salt="other").held_out() != MathTask().held_out()


def test_about_the_configured_share_of_prompts_is_held_out(task):
    problems = [task.problem("".join(a), b) for a in itertools.product("0123456789", repeat=3) for b in "12"]
    share = sum(task.is_held_out(p) for p in problems) / len(problems)
    assert share == pytest.approx(0.2, abs=0.03)


def test_chance_and_best_constant_rewards(task):
    assert task.chance_reward() == pytest.approx(1 / 22)
    assert 0.1 <= task.best_constant_reward() < 0.2  # 0.1 in expectation; a finite sample is a bit above


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"digits": 0}, "digits must be an integer in \\[1, 8\\], got 0"),
        ({"addends": "1a"}, "addends must be distinct digits"),
        ({"addends": "11"}, "addends must be distinct digits"),
        ({"held_out_percent": 60}, "held_out_percent must be in \\[1, 50\\], got 60"),
        ({"held_out_size": 500}, "held_out_size must be in \\[1, 200\\]"),
    ],
)
def test_config_names_the_bad_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        MathConfig(**overrides)


def test_registry_builds_by_name_and_lists_the_choices():
    assert isinstance(make_task("math", digits=4), MathTask)
    assert make_task("math", digits=4).max_tokens == 4
    with pytest.raises(ValueError, match="unknown task 'maths'; choose one of \\['math', 'swe', 'throughput'\\]"):
        make_task("maths")
    assert sorted(TASKS) == ["math", "swe", "throughput"]


def test_task_tokenizer_has_one_token_per_character():
    tok = task_tokenizer()
    assert tok.vocab_size == 5 + len(ALPHABET) == 22
    assert (tok.token_to_id(ENDOFTEXT), tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    assert tok.eos_token_id == 0
    assert tok.stop_token_ids == (2, 0)
    ids = tok.encode("483+1=594")
    assert len(ids) == 9
    assert tok.decode(ids) == "483+1=594"
    assert tok.encode(f"{IM_START}7{IM_END}") == [1, tok.token_to_id("7"), 2]
    assert tok.decode([1, tok.token_to_id("7"), 2], skip_special_tokens=True) == "7"


def test_task_prompts_and_answers_tokenize_to_single_characters(task):
    for p in task.held_out()[:20]:
        assert len(task.tokenizer.encode(p.prompt)) == len(p.prompt) == 6
        assert len(task.tokenizer.encode(p.answer)) == task.max_tokens


def test_task_tokenizer_is_deterministic_and_refuses_unknown_characters():
    assert char_tokenizer().backend.to_str() == char_tokenizer().backend.to_str()
    with pytest.raises(Exception, match="UNK"):
        task_tokenizer().encode("12a")
    with pytest.raises(ValueError, match="no repeated character"):
        char_tokenizer("1123")


def test_task_tokenizer_saves_and_loads(tmp_path):
    from reference.tokenizer import Tokenizer

    task_tokenizer().save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.encode("979+2=") == task_tokenizer().encode("979+2=")


def test_the_task_cli_prints_the_random_policy_reward(capsys):
    from reference.tasks.__main__ import main

    main(["math", "--samples", "300"])
    out = capsys.readouterr().out
    assert "random-policy reward 0.0" in out
    assert "held-out evaluation problems: 128" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nosuch"], "error: unknown task 'nosuch'; choose one of ['math', 'swe', 'throughput']"),
        (["no_such_module:Task"], "error: task 'no_such_module:Task': cannot import 'no_such_module'"),
        (["math", "--samples", "0"], "error: --samples must be >= 1, got 0"),
    ],
)
def test_the_task_cli_refuses_a_mistake_in_one_line_and_exit_2(argv, needle, capsys):
    from reference.tasks.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


def test_the_task_cli_describes_a_task_that_grades_whole_episodes_without_a_random_policy(capsys):
    """A task without grade(problem, completion) (an agent task: SWE's episodes are graded in sandboxes) is
    described, and says why it has no random-policy reward here, rather than failing with an AttributeError."""
    from reference.tasks.__main__ import describe

    class EpisodeOnly:
        def __init__(self):
            self.math = MathTask()
            self.tokenizer, self.max_tokens = self.math.tokenizer, self.math.max_tokens

        def sample_train(self, rng, n):
            return [dataclasses.replace(p, prompt="") for p in self.math.sample_train(rng, n)]

        def held_out(self):
            return self.math.held_out()[:5]

    assert describe(EpisodeOnly(), 10, 0) == 0
    out = capsys.readouterr().out
    assert "held-out evaluation problems: 5" in out and "(the agent writes the prompt)" in out
    assert "random-policy reward: not measured here: EpisodeOnly grades whole episodes where they run" in out
