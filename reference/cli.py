"""`python -m reference COMMAND`: run the data plane.

serve            engines (each in its own process) + the trajectory manager on one machine
engine           one engine process (what `serve` starts; also usable on its own)
check            re-score stored trajectories: token-id mismatches (must be 0), logprob drift
export           stored trajectories as JSON Lines
train            GRPO training on real engines and trainer shards under a scheduling policy
build-tokenizer  rebuild the shipped byte-level BPE tokenizer from the shipped corpus

A user's mistake (a bad flag value, a port in use, a missing store) is one `error:` line and exit code 2,
found before an engine starts or a file is written; Ctrl-C exits with 130, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from core.cli import EXIT_INTERRUPTED, run_main
from core.errors import UserError
from reference.engine.auth import MANAGER_TOKEN_ENV
from reference.engine.base import MAX_SEED
from reference.manager.load import GC_YOUNG_OBJECTS, tune_gc

# Everything that imports aiohttp, torch or the manager is imported where it is used: the first half
# second of a command is then inside `main`, where Ctrl-C is an exit code, not a traceback.

ADMIN_TOKEN_ENV = MANAGER_TOKEN_ENV  # the manager's token, from the environment (engines never see it)

# The values each numeric flag allows: (lowest, highest or None). Checked before anything starts, so a bad
# value is one line naming the flag, not an error from deep inside a constructor or an engine process.
ENGINE_FLAG_RANGES = {
    "--seed": (0, MAX_SEED),
    "--max-batch": (1, None),
    "--coalesce-s": (0, None),
    "--torch-threads": (0, None),
}
SERVE_FLAG_RANGES = {
    "--engines": (1, None),
    "--default-max-tokens": (1, None),
    "--max-in-flight": (0, None),
    "--max-loop-lag-s": (0, None),
    "--max-tokens-in-memory": (1, None),
    "--max-session-tokens": (1, None),
    "--max-pause-s": (0, None),
    "--gc-young": (0, None),
    "--body-timeout-s": (0.001, 3600),
    "--max-body-bytes-in-flight": (1, None),
    "--idle-timeout-s": (0.001, 86400),
}
CHECK_FLAG_RANGES = {"--seed": (0, MAX_SEED), "--version": (0, None), "--temperature": (0, 2)}
SPEC_FLAGS = ("backend", "model", "seed", "max_batch", "heartbeat_s", "coalesce_s", "logprobs_mode")  # EngineSpec's


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The flags of one engine's spec (reference/engine/backends.py), each backend's options among them."""
    from reference.engine.backends import BACKENDS, LOGPROBS_MODES, option_flags

    p.add_argument("--backend", default="builtin", help=f"engine backend: {', '.join(BACKENDS)} (default builtin)")
    p.add_argument("--model", default="default", help="'default' (tiny Qwen3) or a local checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together per engine")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat of a quiet generation stream")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="CPU threads for torch in each engine process (default: cores / engines)",
    )
    p.add_argument(
        "--coalesce-s",
        type=float,
        default=0.0,
        help="wait this long after a token for more to send in one line (default 0)",
    )
    p.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="processed",
        help="each token's log-prob: of the distribution it was drawn from (processed, the default) or of the "
        "model at temperature 1 (raw)",
    )
    for flag, option in option_flags().items():
        p.add_argument(flag, type=option.kind, default=None, help=option.help)


def _spec(args):
    """The engine spec the flags give: `--spec-json` whole, or built from the other engine flags."""
    from reference.engine.backends import EngineSpec, option_flags

    optional = ["torch_threads", *(o.field for o in option_flags().values())]  # None: not given
    if getattr(args, "spec_json", None) is not None:
        given = [k for k in SPEC_FLAGS if getattr(args, k) != getattr(EngineSpec, k)]
        given += [k for k in optional if getattr(args, k) is not None]
        if given:
            raise UserError(f"--spec-json carries the whole engine spec; drop --{given[0].replace('_', '-')}")
        return EngineSpec.from_json(args.spec_json)
    options = {k: getattr(args, k) for k in optional[1:] if getattr(args, k) is not None}
    common = {k: getattr(args, k) for k in SPEC_FLAGS}
    return EngineSpec(**common, torch_threads=_threads(args), options=options)


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
    s.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="use a running engine server instead of starting engines (repeatable)",
    )
    s.add_argument("--store", default="results/trajectories.sqlite", help="SQLite trajectory store (WAL)")
    s.add_argument("--model-name", default=None, help="the name agents pass as `model` (default: from --model)")
    s.add_argument("--default-max-tokens", type=int, default=1024)
    s.add_argument("--admin-token", default=None, help=argparse.SUPPRESS)  # refused with a message, see admin_token
    s.add_argument(
        "--no-admin-token",
        action="store_true",
        help="loopback only: no control token (without this and without a token given, one is "
        "generated and written to STORE.admin-token, readable by this user alone)",
    )
    s.add_argument(
        "--admin-token-file",
        default=None,
        help=f"a file holding the token that everything but the agents' calls needs "
        f"(default: ${ADMIN_TOKEN_ENV}; none). Required to bind a non-loopback --host",
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients may use in their Host header besides loopback names and IP addresses "
        "(repeatable; '*': any). Other names get 403: a web page that rebinds its domain to this "
        "machine still sends its own name",
    )
    s.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (scheme://host:port) whose pages may call the server (repeatable; '*': any); "
        "browsers' other cross-site requests get 403",
    )
    s.add_argument(
        "--max-in-flight",
        type=int,
        default=4096,
        help="agent requests served at once; beyond it 429 (0: no cap; default 4096)",
    )
    s.add_argument(
        "--body-timeout-s",
        type=float,
        default=30.0,
        help="an agent request's body must arrive within this, else 408; until it has, it holds no "
        "in-flight slot (default 30)",
    )
    s.add_argument(
        "--idle-timeout-s",
        type=float,
        default=75.0,
        help="a connection with no request under way (or its headers not all in) closes after this (default 75)",
    )
    s.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        default=64 << 20,
        help="request bodies read, parsed or tokenised at once, all connections; beyond it 429 before a "
        "body is read (default 64 MiB)",
    )
    s.add_argument(
        "--max-loop-lag-s",
        type=float,
        default=0.1,
        help="the in-flight limit falls while the loop lags more than this (0: a fixed cap)",
    )
    s.add_argument(
        "--max-tokens-in-memory",
        type=int,
        default=16_000_000,
        help="tokens all sessions in memory may hold; idle ones beyond it leave for the store",
    )
    s.add_argument(
        "--max-session-tokens",
        type=int,
        default=2_000_000,
        help="an idle session holding more tokens than this leaves memory for the store",
    )
    s.add_argument(
        "--max-pause-s",
        type=float,
        default=900.0,
        help="resume engines paused longer than this without a resume (0: never; default 900)",
    )
    s.add_argument(
        "--gc-young",
        type=int,
        default=GC_YOUNG_OBJECTS,
        help=f"collect young garbage every this many objects (default {GC_YOUNG_OBJECTS:,}; 0: "
        "Python's 700, which costs the manager a quarter of its core under load)",
    )
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _engine_args(s)
    e = sub.add_parser("engine", help="one engine process behind HTTP")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=0, help="0 picks a free port (announced on stdout)")
    e.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    e.add_argument(
        "--spec-json",
        default=None,
        metavar="JSON",
        help="the whole engine spec as one JSON document, instead of the flags below (as the runtime starts one)",
    )
    _engine_args(e)
    c = sub.add_parser("check", help="consistency of stored trajectories against the model")
    c.add_argument(
        "--store",
        default="results/trajectories.sqlite",
        help="a trajectory store, or a training run's folder (the store in it)",
    )
    c.add_argument(
        "--model",
        default=None,
        help="'default' (the tiny serving model) or a local checkpoint directory (default: for a training "
        "run's store, the run's own tokenizer and each token's version of its weights; else "
        "'default')",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the default model")
    c.add_argument("--session", action="append", help="only these sessions (repeatable)")
    c.add_argument("--version", type=int, default=None, help="compare logprobs only of tokens of this version")
    c.add_argument(
        "--temperature",
        type=float,
        help="the tokens' sampling temperature, 0..2 (default: the run's rollout.temperature, else 1)",
    )
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
    from reference.engine.auth import is_loopback

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
    if token is not None and getattr(args, "no_admin_token", False):
        raise ValueError(f"--no-admin-token with a token given (--admin-token-file or ${ADMIN_TOKEN_ENV}): choose one")
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"refusing to serve on non-loopback host {args.host!r} without a token: anyone who can reach the "
            f"port could read trajectories and change rewards and weights. Set ${ADMIN_TOKEN_ENV} or "
            f"--admin-token-file, or bind 127.0.0.1"
        )
    return token


GENERATED_TOKEN_SUFFIX = ".admin-token"  # beside the store: `serve`'s control token when none is given


def generated_token_path(store: str) -> Path:
    return Path(f"{store}{GENERATED_TOKEN_SUFFIX}")


def write_generated_token(path: Path) -> str:
    """A fresh control token, written to `path` readable and writable by this user alone (replacing a file a
    previous run left; refusing anything but a regular file there)."""
    import secrets
    import stat

    token = secrets.token_urlsafe(32)
    if path.is_symlink() or (path.exists() and not stat.S_ISREG(path.lstat().st_mode)):
        raise ValueError(f"cannot write the control token to {str(path)!r}: it is not a regular file")
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _config(args, model_name: str, token: str | None):
    from reference.manager.manager import ManagerConfig

    return ManagerConfig(
        model_name=model_name,
        default_max_tokens=args.default_max_tokens,
        admin_token=token,
        max_in_flight_requests=args.max_in_flight,
        max_tokens_in_memory=args.max_tokens_in_memory,
        max_session_tokens_in_memory=args.max_session_tokens,
        max_pause_s=args.max_pause_s,
        max_loop_lag_s=args.max_loop_lag_s,
        allowed_hosts=tuple(args.allowed_host),
        body_timeout_s=args.body_timeout_s,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        idle_timeout_s=args.idle_timeout_s,
        allowed_origins=tuple(args.allowed_origin),
    )


def _check_flags(args, ranges: dict[str, tuple[float, float | None]]) -> None:
    """UserError naming the first flag whose value is outside its range (NaN is outside every range)."""
    for flag, (low, high) in ranges.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and not (value >= low and (high is None or value <= high)):
            allowed = f">= {low}" if high is None else f"in {low}..{high}"
            raise UserError(f"{flag} must be {allowed}, got {value}")


def _check_engine_flags(args) -> None:
    """What `serve` and `engine` check before an engine process starts (there, a bad value is a traceback)."""
    from reference.engine.backends import backend, check_available, option_flags

    if getattr(args, "spec_json", None) is not None:
        spec = _spec(args)
        check_available(spec.backend, spec.model)
        return
    _check_flags(args, ENGINE_FLAG_RANGES)
    if not args.heartbeat_s > 0:
        raise UserError(
            f"--heartbeat-s must be > 0 (seconds between heartbeats of a quiet stream), got {args.heartbeat_s}"
        )
    backend(args.backend)  # an unknown name lists the valid ones
    for flag, option in option_flags().items():
        if getattr(args, option.field) is not None and args.backend not in option.ranges:
            raise UserError(f"{flag} is an option of backend {', '.join(option.ranges)}, not of {args.backend}")
        if args.backend in option.ranges:
            _check_flags(args, {flag: option.ranges[args.backend]})
    check_available(args.backend, args.model)


def _check_serve_flags(args) -> None:
    _check_flags(args, SERVE_FLAG_RANGES)
    for flag in ("allowed_host", "allowed_origin"):
        for value in getattr(args, flag):
            if not value.strip():
                raise UserError(f"--{flag.replace('_', '-')} must name a host or an origin, got {value!r}")
    if not args.store:  # SQLite would open a private temporary database, lost at exit
        raise UserError("--store must name a file (the SQLite trajectory store)")
    for url in args.engine_url:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--engine-url must be http://HOST:PORT (an engine server), got {url!r}")
    if not args.engine_url:
        _check_engine_flags(args)


def serve(args) -> int:
    """Check every flag and bind the port before anything starts (a refusal starts and writes nothing), then
    start the engines, open the store and serve until SIGINT (exit 130) or SIGTERM (0)."""
    from reference.engine.process import EngineProcess
    from reference.engine.sockets import listen_sockets
    from reference.manager.connections import LISTEN_BACKLOG
    from reference.manager.store import TrajectoryStore

    _check_serve_flags(args)
    spec = _spec(args)
    model_name = args.model_name or ("seamlessflow-tiny" if args.model == "default" else Path(args.model).name)
    token = admin_token(args)
    config = _config(args, model_name, token)  # every setting checked before anything is bound or written
    tokenizer = _load_tokenizer(args.model)
    sockets = listen_sockets(args.host, args.port, LISTEN_BACKLOG)
    generated = None
    if token is None and not args.no_admin_token:
        generated = generated_token_path(args.store)
        try:
            token = write_generated_token(generated)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        print(
            f"control token: {generated} (trajectories, rewards, stats and the control endpoints need "
            f"'Authorization: Bearer <its content>'; --no-admin-token for none)",
            file=sys.stderr,
        )
        config = dataclasses.replace(config, admin_token=token)
    tune_gc(args.gc_young)
    procs: dict[str, EngineProcess] = {}
    store = None
    try:
        if not args.engine_url:  # started outside the event loop, so that Ctrl-C interrupts a slow start at once
            print(f"starting {args.engines} {spec.backend} engine(s) for {args.model} ...", file=sys.stderr)
            for i in range(args.engines):
                procs[f"engine-{i}"] = EngineProcess(spec)
        store = TrajectoryStore(args.store)
        return asyncio.run(_serve_manager(args, model_name, sockets, procs, tokenizer, store, config))
    finally:
        for p in procs.values():
            p.close()
        if store is not None:
            store.close()
        for sock in sockets:  # the server closed them already if it started
            sock.close()
        if generated is not None:
            generated.unlink(missing_ok=True)


async def _serve_manager(args, model_name: str, sockets, procs, tokenizer, store, config) -> int:
    from reference.engine.auth import token_from_env
    from reference.engine.client import HTTPEngine
    from reference.engine.process import stop_signals
    from reference.engine.sockets import bound_port
    from reference.manager.manager import TrajectoryManager
    from reference.manager.server import start_manager_server

    stopped = stop_signals(asyncio.get_running_loop())
    if args.engine_url:  # engines started elsewhere: their token comes from the environment
        token = token_from_env()
        engines = {f"engine-{i}": HTTPEngine(url, token=token) for i, url in enumerate(args.engine_url)}
    else:
        engines = {name: p.client() for name, p in procs.items()}
    runner = None
    try:
        manager = TrajectoryManager(engines, tokenizer, store, config, processes=procs)
        runner = await start_manager_server(manager, sockets=sockets)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"trajectory manager on http://{host}:{bound_port(runner)}/s/<session_id>/v1 (model {model_name!r}); "
            f"trajectories in {args.store}; Ctrl-C stops",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED if await stopped == signal.SIGINT else 0
    finally:
        if runner is not None:
            await runner.cleanup()
        for client in engines.values():
            await client.close()


def engine(args) -> int:
    """One engine process: the port is bound before the model loads; SIGINT exits with 130, SIGTERM with 0."""
    from reference.engine.process import serve_engine

    _check_engine_flags(args)
    # asyncio.run's own Ctrl-C handling only cancels its task, which cannot stop a model that loads
    # synchronously inside it (minutes for vLLM); this handler interrupts at once (the server's own
    # handlers replace it once it serves).
    previous = signal.signal(signal.SIGINT, _interrupt)
    try:
        stopped = asyncio.run(serve_engine(_spec(args), args.host, args.port, args.watch_stdin))
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_INTERRUPTED if stopped == signal.SIGINT else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _require_store(path: str) -> None:
    """`check` and `export` read a store `serve` or `train` wrote; they never create one."""
    if not Path(path).is_file():
        raise UserError(f"no trajectory store at {path} (`serve` and `train` write one); name it with --store FILE")


def check(args) -> int:
    """Re-score a store (`reference.consistency`): the JSON report on stdout, progress and one verdict line on
    stderr; exit 0 (OK), 1 (token mismatches) or 2 (a user's mistake: no store, an unknown session or version)."""
    from reference.consistency import CheckProgress, RunWeights, check_store, run_of_store, scoring_temperature, verdict
    from reference.manager.store import TrajectoryStore

    _check_flags(args, CHECK_FLAG_RANGES)
    path = Path(args.store)
    if path.is_dir():  # a training run's folder
        path = path / "trajectories.sqlite"
    _require_store(str(path))
    run = run_of_store(path) if args.model is None else None
    model = weights = None
    if run is not None:
        weights = RunWeights(run / "weights")
        tokenizer = weights.tokenizer()
        if args.version is not None and args.version not in weights.versions:
            raise UserError(
                f"--version {args.version}: the run keeps no weights of it in {run / 'weights'} "
                f"(kept: {', '.join(map(str, weights.versions))})"
            )
    else:
        model, tokenizer = _load_model(args.model or "default", args.seed)
    temperature = scoring_temperature(args.temperature, run_of_store(path))  # a run's own, where --model is given
    scoring = {"weights": weights, "temperature": temperature}
    with TrajectoryStore(path) as store:
        sessions = args.session or store.sessions()
        if missing := [s for s in sessions if not store.has_session(s)]:
            raise UserError(f"--session {missing[0]!r}: no such session in {path}")
        if weights is not None:
            print(
                f"check: the store of training run {run}: its tokenizer; each token re-scored at temperature "
                f"{temperature:g} with the weights of the version that sampled it where the run kept them (versions "
                f"{_spans(weights.versions)}), the others' token ids checked",
                file=sys.stderr,
            )
        with CheckProgress(len(sessions)) as progress:
            report = check_store(store, model, tokenizer, sessions, args.version, progress=progress, **scoring)
    print(json.dumps(report.to_dict(), indent=2), flush=True)
    print(verdict(report), file=sys.stderr)
    return 0 if report.ok else 1


def _spans(versions: list[int]) -> str:
    """[0, 28, 29, 30] -> '0, 28-30'."""
    spans: list[list[int]] = []
    for v in versions:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def export(args) -> int:
    from reference.export import export_jsonl
    from reference.manager.store import TrajectoryStore

    _require_store(args.store)
    with TrajectoryStore(args.store) as store:
        count = export_jsonl(store, args.out, args.session, args.rewarded_only)
    print(f"{count} branches written to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user's mistake is one `error:` line and exit code 2, Ctrl-C exit code 130."""
    # UserError is a ValueError; OSError: a file, a port
    return run_main(lambda: _run(parser().parse_args(argv)), usage_errors=(ValueError, OSError, RuntimeError))


def _run(args) -> int:
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for chatty in ("httpx", "httpx2", "LiteLLM", "minisweagent"):  # agents' HTTP clients log every call at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if args.command == "serve":
        return serve(args)
    if args.command == "engine":
        return engine(args)
    if args.command == "check":
        return check(args)
    if args.command == "export":
        return export(args)
    if args.command == "train":
        from reference.control.cli import train_main

        tune_gc()  # this process runs the trajectory manager
        return train_main(args)
    from reference.tokenizer import rebuild_default_tokenizer  # build-tokenizer

    print(rebuild_default_tokenizer())
    return 0
