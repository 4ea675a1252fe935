"""A scripted engine that plays back demonstrations, so a demonstration is stored like any rollout.

`demonstration_engine(pairs, tokenizer)` is an `InferenceEngine` (reference/engine/base.py) whose
replies are not sampled but read from the demonstrations: for a conversation whose prompt holds a
task's problem statement and k finished assistant turns, it emits the tokens of step k, the step's
thought and then `<tool_call>{"name": "bash", "arguments": {"command": ...}}</tool_call>` in Qwen's
"hermes" format, with the manager's tokenizer, ending on `<|im_end|>`. The final `SUBMIT_COMMAND` step
becomes a `submit` call. Replaying a demonstration through the real manager and the built-in agent
(`replay_demonstration`) runs each command in the agent's runner, so the stored trajectory holds the
observations the agent really saw: training data in exactly the shape of a rollout.

It is built on `reference.engine.fake.ScriptedEngine`, which supplies the protocol's pause, weight
update, resume and abort; its logprobs are made up (a supervised warm start does not read them). A
request continued after a weight update mid-reply would restart its step: do not pause it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from reference.engine.fake import ScriptedEngine
from swebench_env.agent import AgentConfig, BashAgent, Episode
from swebench_env.demos import SUBMIT_COMMAND, Demonstration, Step
from swebench_env.runner import CommandRunner
from swebench_env.tasks import Instance

DEFAULT_MAX_CONTEXT = 32768  # tokens; the scripted engine holds no cache, so it can be generous
NO_DEMONSTRATION = "I have no demonstration for this conversation."
REPLAY_MAX_TOKENS = 4096  # per reply: the longest step (a heredoc script rewriting a block) fits


def step_message(step: Step, submit_tool: bool = True) -> str:
    """The assistant turn that plays `step`: its thought, then its command as a bash call (the final submit step
    as a `submit` call, or with `submit_tool=False`, for agents with only a bash tool, as the submit command)."""
    if step.command == SUBMIT_COMMAND and submit_tool:
        call = {"name": "submit", "arguments": {}}
    else:
        call = {"name": "bash", "arguments": {"command": step.command}}
    return f"{step.thought}\n<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


class DemonstrationScript:
    """`script(prompt_token_ids) -> reply token ids`: which demonstration is found by the problem statement
    in the prompt, which step by the number of assistant turns the prompt already holds. `submit_tool`: see
    `step_message`."""

    def __init__(self, pairs: Iterable[tuple[Instance, Demonstration]], tokenizer, submit_tool: bool = True) -> None:
        self.tok = tokenizer
        self.submit_tool = submit_tool
        self._by_statement: dict[str, Demonstration] = {}
        for task, demo in pairs:
            if task.instance_id != demo.instance_id:
                raise ValueError(f"demonstration {demo.instance_id!r} is paired with task {task.instance_id!r}")
            statement = task.problem_statement.strip()
            if statement in self._by_statement:
                other = self._by_statement[statement].instance_id
                raise ValueError(f"tasks {other!r} and {task.instance_id!r} have the same problem statement")
            self._by_statement[statement] = demo
        # How every assistant turn opens in the chat template, the generation prompt included.
        self._header = [tokenizer.im_start_id, *tokenizer.encode("assistant\n")]

    def __call__(self, prompt_token_ids: Sequence[int]) -> list[int]:
        demo = self.demonstration(prompt_token_ids)
        if demo is None:
            return [*self.tok.encode(NO_DEMONSTRATION), self.tok.im_end_id]
        k = min(self.assistant_turns(prompt_token_ids), len(demo.steps) - 1)  # past the end: submit again
        return [*self.tok.encode(step_message(demo.steps[k], self.submit_tool)), self.tok.im_end_id]

    def demonstration(self, prompt_token_ids: Sequence[int]) -> Demonstration | None:
        """The demonstration whose task's problem statement the prompt holds (the longest, if several)."""
        text = self.tok.decode(list(prompt_token_ids))
        found = [s for s in self._by_statement if s in text]
        return self._by_statement[max(found, key=len)] if found else None

    def assistant_turns(self, prompt_token_ids: Sequence[int]) -> int:
        """Finished assistant turns in a chat prompt (which ends with the generation prompt)."""
        ids, header, first = list(prompt_token_ids), self._header, self._header[0]
        starts = [i for i, t in enumerate(ids) if t == first and ids[i : i + len(header)] == header]
        return max(0, len(starts) - 1)


def demonstration_engine(
    pairs: Iterable[tuple[Instance, Demonstration]],
    tokenizer,
    max_context: int = DEFAULT_MAX_CONTEXT,
    submit_tool: bool = True,
) -> ScriptedEngine:
    """An engine that plays back `pairs` (task, its demonstration) to the built-in agent (or, with
    `submit_tool=False`, to an agent whose only tool is bash, such as mini-swe-agent)."""
    return ScriptedEngine(
        DemonstrationScript(pairs, tokenizer, submit_tool), vocab_size=tokenizer.vocab_size, max_context=max_context
    )


def demonstration_manager(
    pairs: Iterable[tuple[Instance, Demonstration]],
    tokenizer=None,
    store: str | Path = ":memory:",
    config=None,
    submit_tool: bool = True,
):
    """A trajectory manager in a background thread (`ManagerThread`: use it with `with`) whose one engine
    plays back `pairs`; `tokenizer` defaults to the shipped one, `config` is a `ManagerConfig`, `submit_tool`
    as for `demonstration_engine`."""
    from reference.manager.embedded import ManagerThread
    from reference.tokenizer import default_tokenizer

    tokenizer = tokenizer or default_tokenizer()
    engine = demonstration_engine(pairs, tokenizer, submit_tool=submit_tool)
    return ManagerThread({"demonstrations": engine}, tokenizer, store, config)


def replay_demonstration(
    task: Instance,
    demo: Demonstration,
    manager_url: str,
    runner: CommandRunner,
    config: AgentConfig | None = None,
    session_id: str | None = None,
) -> Episode:
    """Run the built-in agent on `task` in `runner` against a manager whose engine plays `demo`
    (`demonstration_engine`); the episode's turns are the demonstration's steps."""
    config = config or AgentConfig(max_turns=len(demo.steps) + 1)
    session_id = session_id or f"demo:{task.instance_id}:{uuid.uuid4().hex[:8]}"
    return BashAgent(config).run(task, runner, manager_url, session_id)


# ---- the command line (`python -m swebench_env replay`; the parser is in cli.py) ----


def replay_command(args, tasks: Sequence[Instance]) -> int:
    """Replay `tasks`' demonstrations through an in-process manager whose engine plays them, in sandboxes or
    locally (`--sandbox`), grade each patch and store the reward; exit code 1 unless every replay resolves."""
    from core.outputs import prepare_out
    from reference.tokenizer import Tokenizer, default_tokenizer
    from swebench_env.demos import load_demonstrations
    from swebench_env.rollout import SweRolloutConfig, environment, rollout_to

    if not tasks:
        raise ValueError(f"{args.tasks} holds no task to replay")
    demos = {d.instance_id: d for d in load_demonstrations(args.demos)}
    missing = [t.instance_id for t in tasks if t.instance_id not in demos]
    if missing:
        raise ValueError(f"{args.demos} has no demonstration for {missing[0]!r} ({len(missing)} tasks lack one)")
    pairs = [(t, demos[t.instance_id]) for t in tasks]
    tok = default_tokenizer() if args.tokenizer == "default" else Tokenizer.load(args.tokenizer)
    config = AgentConfig(
        max_turns=max(len(d.steps) for _, d in pairs) + 1,
        max_tokens=REPLAY_MAX_TOKENS,
        command_timeout_s=args.command_timeout_s,
        temperature=0.0,
    )
    DemonstrationScript(pairs, tok)  # checks the pairing before `prepare_out`: a bad one writes nothing
    workspace, grader = environment(args.sandbox, args.image)
    out = prepare_out(args.out, args.out, args.overwrite)
    store = out / "trajectories.sqlite"
    settings = {
        "command": "replay",
        "tasks": str(args.tasks),
        "demos": str(args.demos),
        "instances": len(tasks),
        "tokenizer": args.tokenizer,
        "sandbox": args.sandbox,
        "agent_config": asdict(config),
    }
    with demonstration_manager(pairs, tok, store) as manager:
        rollout = SweRolloutConfig(manager.url, args.concurrency, run_id=f"replay-{uuid.uuid4().hex[:8]}")
        results = rollout_to(out, tasks, BashAgent(config), rollout, settings, grader, workspace)
    resolved = sum(r.resolved for r in results)
    print(
        f"replayed {len(results)} demonstrations: {resolved} resolved; trajectories in {store} "
        f"(python -m reference check --store {store})"
    )
    return 0 if resolved == len(results) else 1
