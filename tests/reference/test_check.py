"""`python -m reference check`: a training run's store checked with the run's own tokenizer and weights, progress on
long work, one verdict line and exit 0/1; a wrong store is one line and exit 2."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from reference import consistency  # noqa: E402
from reference.cli import main  # noqa: E402
from reference.consistency import ConsistencyReport, score_batch, verdict  # noqa: E402
from reference.manager.store import NewTurn, TrajectoryStore  # noqa: E402
from reference.model import build_model, save_checkpoint, score_logprobs, tiny_config  # noqa: E402
from reference.tokenizer import default_tokenizer  # noqa: E402
from reference.trainer.handoff import version_dir  # noqa: E402

SESSIONS, GROUP = 3, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A training run's folder as `python -m reference train` leaves it: config.yaml, weights/ (version 0 kept, 1
    pruned) and trajectories.sqlite; sessions 0 and 1 sampled under version 0 (logprobs of those weights), session
    2 under version 1 (weights gone: its ids are checked, its logprobs not)."""
    return write_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def hot_run(tmp_path_factory) -> Path:
    """The same run sampled at rollout.temperature 0.7: its logprobs are of softmax(logits / 0.7)."""
    return write_run(tmp_path_factory.mktemp("hot-run"), temperature=0.7)


def write_run(out: Path, temperature: float | None = None) -> Path:
    """`run`'s folder; with `temperature`, its config says rollout.temperature and its logprobs are at it."""
    tokenizer = default_tokenizer()
    model = build_model(tiny_config(tokenizer.vocab_size, hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32), seed=3)  # fmt: skip
    save_checkpoint(model, tokenizer, version_dir(out / "weights", 0))
    rollout = f"rollout: {{temperature: {temperature}}}\n" if temperature is not None else ""
    (out / "config.yaml").write_text("policy: {name: tag}\n" + rollout)
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        for s in range(SESSIONS):
            prompt = tokenizer.encode(f"problem {s}: 12 + 34 =")
            for k in range(GROUP):
                reply = tokenizer.encode(f" {46 + k}")
                if s < 2:
                    logprobs = score_logprobs(model, prompt + reply, temperature or 1.0)[len(prompt) - 1 :]
                    version = 0
                else:
                    logprobs, version = [-1.0] * len(reply), 1
                turn = NewTurn(f"s{s}", f"s{s}-r{k}", f"s{s}-r0" if k else None, len(prompt) if k else 0,
                               [] if k else prompt, reply, logprobs, [version] * len(reply), "stop", "")  # fmt: skip
                store.append_many([turn])
    return out


def generated(run: Path, sessions) -> int:
    with TrajectoryStore(run / "trajectories.sqlite") as store:
        return sum(len(r.token_ids) for s in sessions for r in store.records(s))


def test_a_runs_store_is_checked_with_the_runs_own_weights(run, capsys):
    start = time.monotonic()
    assert main(["check", "--store", str(run)]) == 0
    assert time.monotonic() - start < 60
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["requests"] == SESSIONS * GROUP and report["token_mismatches"] == 0
    assert report["retokenize_mismatched_branches"] == 0  # the run's tokenizer
    assert report["scored_tokens"] == generated(run, ["s0", "s1"])  # version 1's weights are gone
    assert report["max_logprob_diff"] < 1e-4
    lines = captured.err.splitlines()
    assert lines[0].startswith(f"check: the store of training run {run}: its tokenizer") and "versions 0)" in lines[0]
    assert lines[-1] == (f"check: OK — {SESSIONS * GROUP} records, 0 token mismatches; {report['scored_tokens']} "
                         f"tokens re-scored, largest logprob difference {report['max_logprob_diff']:.2g}")  # fmt: skip
    # the store file itself says the same; --version picks version 0's tokens alone
    assert main(["check", "--store", str(run / "trajectories.sqlite"), "--version", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["scored_tokens"] == report["scored_tokens"]


def test_a_run_sampled_at_a_temperature_is_rescored_at_it(hot_run, capsys):
    """Its engines stored the log-probs of softmax(logits / 0.7): the check re-scores at the run's temperature."""
    assert main(["check", "--store", str(hot_run)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["scored_tokens"] == generated(hot_run, ["s0", "s1"])
    assert report["max_logprob_diff"] < 1e-4
    assert captured.err.splitlines()[0].startswith(
        f"check: the store of training run {hot_run}: its tokenizer; each token re-scored at temperature 0.7 with"
    )
    assert main(["check", "--store", str(hot_run), "--temperature", "1"]) == 0  # said otherwise: the raw model's
    assert json.loads(capsys.readouterr().out)["max_logprob_diff"] > 0.05


def test_a_temperature_out_of_range_is_one_line(run, capsys):
    assert main(["check", "--store", str(run), "--temperature", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --temperature must be in 0..2, got 3.0"]


def test_a_version_whose_weights_are_gone_is_one_line(run, capsys):
    assert main(["check", "--store", str(run), "--version", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --version 1: the run keeps no weights of it in {run / 'weights'} (kept: 0)"
    ]


def test_model_default_still_rescores_everything_with_the_serving_model(run, capsys):
    assert main(["check", "--store", str(run), "--model", "default"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scored_tokens"] == generated(run, ["s0", "s1", "s2"])


@pytest.mark.parametrize("where", ["missing", "folder", "not-a-store"])
def test_a_wrong_store_is_one_line_and_exit_2(tmp_path, capsys, where):
    path = {"missing": tmp_path / "nope" / "t.sqlite", "folder": tmp_path, "not-a-store": tmp_path / "x.sqlite"}[where]
    if where == "not-a-store":
        path.write_text("hello\n" * 100)
    assert main(["check", "--store", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("error: "), captured.err


def test_an_unknown_session_is_one_line(run, capsys):
    assert main(["check", "--store", str(run), "--session", "nope"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --session 'nope': no such session in {run}/trajectories.sqlite"
    ]


def test_long_work_prints_a_line_now_and_then_when_stderr_is_not_a_terminal(run, capsys, monkeypatch):
    monkeypatch.setattr(consistency, "PROGRESS_LINE_S", 0.0)
    assert main(["check", "--store", str(run)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[1:-1] == [f"check: {n} of {SESSIONS} sessions ({n / SESSIONS:.0%}), 0 s" for n in range(1, 4)]


def test_a_terminal_gets_a_bar_instead(run, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(consistency, "PROGRESS_LINE_S", 0.0)
    stderr = Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["check", "--store", str(run)]) == 0
    text = stderr.getvalue()
    assert "check: 1 of 3 sessions" not in text and "\r" in text
    assert text.rstrip("\n").splitlines()[-1].startswith("check: OK — ")


def test_a_mismatch_fails_with_exit_1_and_says_how_many_records(run, capsys, monkeypatch):
    records = TrajectoryStore.records

    def altered(self, session_id):
        out = records(self, session_id)
        if session_id == "s1":  # what the engine reported differs from the trajectory
            out[2] = type(out[2])(**{**out[2].__dict__, "token_ids": tuple(t + 1 for t in out[2].token_ids)})
        return out

    monkeypatch.setattr(TrajectoryStore, "records", altered)
    assert main(["check", "--store", str(run)]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"check: FAILED — 1 of {SESSIONS * GROUP} records differ from what the engine reported (")


def test_the_verdict_line():
    report = ConsistencyReport(sessions=2, branches=8, requests=1024, generated_tokens=5000, token_mismatches=0,
                               scored_tokens=0, max_logprob_diff=0.0, mean_logprob_diff=0.0,
                               retokenize_mismatched_branches=0)  # fmt: skip
    assert verdict(report) == "check: OK — 1,024 records, 0 token mismatches; no logprob re-scored"
    bad = ConsistencyReport(**{**report.to_dict(), "token_mismatches": 7, "mismatched_requests": 3})
    assert verdict(bad) == ("check: FAILED — 3 of 1,024 records differ from what the engine reported (7 token "
                            "mismatches); no logprob re-scored")  # fmt: skip


def test_batched_scoring_is_each_sequence_alone():
    tokenizer = default_tokenizer()
    model = build_model(tiny_config(tokenizer.vocab_size, hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32), seed=1)  # fmt: skip
    sequences = [tokenizer.encode(text) for text in ("a", "hello there", "12 + 34 = 46", "x" * 40, "")]
    for got, seq in zip(score_batch(model, sequences), sequences, strict=True):
        assert got == pytest.approx(score_logprobs(model, seq), abs=1e-5)


def test_a_run_whose_engines_recorded_raw_logprobs_is_rescored_at_temperature_1(tmp_path):
    """engine.logprobs_mode raw: its log-probs are the temperature-1 model's whatever rollout.temperature was."""
    from reference.consistency import scoring_temperature

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("rollout: {temperature: 0.7}\nengine: {logprobs_mode: raw}\n")
    assert scoring_temperature(None, run) == 1.0
    (run / "config.yaml").write_text("rollout: {temperature: 0.7}\nengine: {logprobs_mode: processed}\n")
    assert scoring_temperature(None, run) == 0.7
    assert scoring_temperature(0.5, run) == 0.5  # --temperature, said outright, wins
