"""`python -m reference COMMAND`: run the data plane.

serve            engines (each in its own process) + the trajectory manager on one machine
engine           one engine process (what `serve` starts; also usable on its own)
check            re-score stored trajectories: token-id mismatches (must be 0), logprob drift
train            GRPO training on real engines and trainer shards under a scheduling policy
build-tokenizer  rebuild the shipped byte-level BPE tokenizer from the shipped corpus
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from reference.engine.auth import is_loopback, token_from_env
from reference.engine.process import BACKENDS, EngineProcess, EngineSpec, serve_engine
from reference.manager.load import GC_YOUNG_OBJECTS, tune_gc

ADMIN_TOKEN_ENV = "SEAMLESSFLOW_ADMIN_TOKEN"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="builtin", help=f"engine backend: {', '.join(BACKENDS)} (default builtin)")
    p.add_argument("--model", default="default", help="'default' (tiny Qwen3) or a local checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together per engine")
    p.add_argument("--token-delay-s", type=float, default=0.0, help="fake backend: seconds per token")
    p.add_argument("--fake-reply-tokens", type=int, default=12, help="fake backend: tokens before a stop token")
    p.add_argument("--tensor-parallel", type=int, default=1, help="vllm backend: GPUs per engine")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat of a quiet generation stream")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="builtin backend: CPU threads per engine (default: cores / engines)")  # fmt: skip
    p.add_argument("--coalesce-s", type=float, default=0.0,
                   help="wait this long after a token for more to send in one line (default 0)")  # fmt: skip


def _spec(args) -> EngineSpec:
    return EngineSpec(
        backend=args.backend, model=args.model, seed=args.seed, max_batch=args.max_batch,
        token_delay_s=args.token_delay_s, fake_reply_tokens=args.fake_reply_tokens,
        tensor_parallel=args.tensor_parallel, heartbeat_s=args.heartbeat_s, coalesce_s=args.coalesce_s,
        torch_threads=_threads(args),
    )  # fmt: skip


def _threads(args) -> int:
    """CPU threads per engine: as asked, else the machine's cores shared among the engines `serve` starts."""
    if args.torch_threads is not None:
        return args.torch_threads
    return max(1, (os.cpu_count() or 1) // max(1, getattr(args, "engines", 1)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reference", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="engines + trajectory manager (OpenAI server at /s/<session>/v1)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--engines", type=int, default=1, help="engine processes to start (default 1)")
    s.add_argument("--engine-url", action="append", default=[],
                   help="use a running engine server instead of starting engines (repeatable)")  # fmt: skip
    s.add_argument("--store", default="results/trajectories.sqlite", help="SQLite trajectory store (WAL)")
    s.add_argument("--model-name", default=None, help="the name agents pass as `model` (default: from --model)")
    s.add_argument("--default-max-tokens", type=int, default=1024)
    s.add_argument("--admin-token", default=None, help=argparse.SUPPRESS)  # refused with a message, see admin_token
    s.add_argument("--admin-token-file", default=None,
                   help=f"a file holding the token that everything but the agents' calls needs "
                        f"(default: ${ADMIN_TOKEN_ENV}; none). Required to bind a non-loopback --host")  # fmt: skip
    s.add_argument("--max-in-flight", type=int, default=4096,
                   help="agent requests served at once; beyond it 429 (0: no cap; default 4096)")  # fmt: skip
    s.add_argument("--max-loop-lag-s", type=float, default=0.1,
                   help="the in-flight limit falls while the loop lags more than this (0: a fixed cap)")  # fmt: skip
    s.add_argument("--max-tokens-in-memory", type=int, default=16_000_000,
                   help="tokens all sessions in memory may hold; idle ones beyond it leave for the store")  # fmt: skip
    s.add_argument("--max-session-tokens", type=int, default=2_000_000,
                   help="an idle session holding more tokens than this leaves memory for the store")  # fmt: skip
    s.add_argument("--max-pause-s", type=float, default=900.0,
                   help="resume engines paused longer than this without a resume (0: never; default 900)")  # fmt: skip
    s.add_argument("--gc-young", type=int, default=GC_YOUNG_OBJECTS,
                   help=f"collect young garbage every this many objects (default {GC_YOUNG_OBJECTS:,}; 0: "
                        "Python's 700, which costs the manager a quarter of its core under load)")  # fmt: skip
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _engine_args(s)
    e = sub.add_parser("engine", help="one engine process behind HTTP")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=0, help="0 picks a free port (announced on stdout)")
    e.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    _engine_args(e)
    c = sub.add_parser("check", help="consistency of stored trajectories against the model")
    c.add_argument("--store", default="results/trajectories.sqlite")
    c.add_argument("--model", default="default", help="'default' or a local checkpoint directory")
    c.add_argument("--seed", type=int, default=0, help="seed of the default model")
    c.add_argument("--session", action="append", help="only these sessions (repeatable)")
    c.add_argument("--version", type=int, default=None, help="compare logprobs only of tokens of this version")
    x = sub.add_parser("export", help="stored trajectories as JSON Lines, one branch per line")
    x.add_argument("--store", default="results/trajectories.sqlite")
    x.add_argument("--out", required=True, help="the .jsonl file to write")
    x.add_argument("--session", action="append", help="only these sessions (repeatable)")
    x.add_argument("--rewarded-only", action="store_true", help="skip branches without a reward")
    sub.add_parser("build-tokenizer", help="rebuild reference/assets/tokenizer.json")
    from reference.control.cli import add_train_parser

    add_train_parser(sub)
    return p


def _load_model(name: str, seed: int):
    from reference.model import default_model, load_checkpoint

    return default_model(seed=seed) if name == "default" else load_checkpoint(name)


def _load_tokenizer(name: str):
    from reference.tokenizer import Tokenizer, default_tokenizer

    return default_tokenizer() if name == "default" else Tokenizer.load(name)


def admin_token(args) -> str | None:
    """The manager's token: from --admin-token-file, else $SEAMLESSFLOW_ADMIN_TOKEN; never from argv,
    which every local user can read. A non-loopback --host without one is refused."""
    if args.admin_token is not None:
        raise ValueError(
            f"--admin-token is not accepted: a token on the command line is visible to every local user (ps); "
            f"set ${ADMIN_TOKEN_ENV} or use --admin-token-file"
        )
    token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --admin-token-file {args.admin_token_file}: {e}") from None
        if not token:
            raise ValueError(f"--admin-token-file {args.admin_token_file} is empty")
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"refusing to serve on non-loopback host {args.host!r} without a token: anyone who can reach the "
            f"port could read trajectories and change rewards and weights. Set ${ADMIN_TOKEN_ENV} or "
            f"--admin-token-file, or bind 127.0.0.1"
        )
    return token


def _config(args, model_name: str):
    from reference.manager.manager import ManagerConfig

    return ManagerConfig(
        model_name=model_name, default_max_tokens=args.default_max_tokens, admin_token=admin_token(args),
        max_in_flight_requests=args.max_in_flight, max_tokens_in_memory=args.max_tokens_in_memory,
        max_session_tokens_in_memory=args.max_session_tokens, max_pause_s=args.max_pause_s,
        max_loop_lag_s=args.max_loop_lag_s,
    )  # fmt: skip


async def serve(args) -> None:
    from reference.engine.client import HTTPEngine
    from reference.manager.manager import TrajectoryManager
    from reference.manager.server import start_manager_server
    from reference.manager.store import TrajectoryStore

    if args.gc_young < 0:
        raise ValueError(f"--gc-young must be >= 0 (0: Python's defaults), got {args.gc_young}")
    spec = _spec(args)
    model_name = args.model_name or ("seamlessflow-tiny" if args.model == "default" else Path(args.model).name)
    config = _config(args, model_name)
    tokenizer = _load_tokenizer(args.model)
    tune_gc(args.gc_young)
    procs: dict[str, EngineProcess] = {}
    store = runner = None
    try:
        if args.engine_url:  # engines started elsewhere: their token comes from the environment
            token = token_from_env()
            engines = {f"engine-{i}": HTTPEngine(url, token=token) for i, url in enumerate(args.engine_url)}
        else:
            print(f"starting {args.engines} {spec.backend} engine(s) for {args.model} ...", file=sys.stderr)
            for i in range(args.engines):
                procs[f"engine-{i}"] = EngineProcess(spec)
            engines = {name: p.client() for name, p in procs.items()}
        store = TrajectoryStore(args.store)
        manager = TrajectoryManager(engines, tokenizer, store, config, processes=procs)
        runner = await start_manager_server(manager, args.host, args.port)
        print(f"trajectory manager on http://{args.host}:{args.port}/s/<session_id>/v1 (model {model_name!r}); "
              f"trajectories in {args.store}; Ctrl-C stops", file=sys.stderr)  # fmt: skip
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        for client in locals().get("engines", {}).values():
            await client.close()
        for p in procs.values():
            p.close()
        if store is not None:
            store.close()


def check(args) -> int:
    from reference.consistency import check_store
    from reference.manager.store import TrajectoryStore

    if not Path(args.store).exists():
        raise FileNotFoundError(f"no trajectory store at {args.store}")
    model, tokenizer = _load_model(args.model, args.seed)
    with TrajectoryStore(args.store) as store:
        report = check_store(store, model, tokenizer, args.session, args.version)
    print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


def export(args) -> int:
    from reference.export import export_jsonl
    from reference.manager.store import TrajectoryStore

    if not Path(args.store).exists():
        raise FileNotFoundError(f"no trajectory store at {args.store}")
    with TrajectoryStore(args.store) as store:
        count = export_jsonl(store, args.out, args.session, args.rewarded_only)
    print(f"{count} branches written to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            asyncio.run(serve(args))
        elif args.command == "engine":
            asyncio.run(serve_engine(_spec(args), args.host, args.port, args.watch_stdin))
        elif args.command == "check":
            return check(args)
        elif args.command == "export":
            return export(args)
        elif args.command == "train":
            from reference.control.cli import train_main

            return train_main(args)
        elif args.command == "build-tokenizer":
            from reference.tokenizer import rebuild_default_tokenizer

            print(rebuild_default_tokenizer())
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
