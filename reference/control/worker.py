"""One resource: a worker process with its own cores, an inference engine and (if it can train) a trainer shard.

A resource never shares compute with another: the worker pins itself to its cores
(`os.sched_setaffinity`) before anything starts, its engine process inherits that mask, and torch in
both uses as many threads as it has cores. While the resource's active tag is `rollout` its engine
serves and the trainer shard is idle; while it is `train` its engine holds no request (the trajectory
manager routes none to it) and the shard computes. Both stay loaded, so a tag switch on CPU costs
only the hand-over, not a reload.

The class is plain Python: `reference/ray/` runs it as a Ray actor (placement by capability tags),
and tests can run it in-process. Every method is synchronous and returns plain data or a frozen record
(`StepMetrics`, `Evaluation`, `WeightsCopy`), which crosses Ray as it is; the driver calls it through the typed
handles of `reference/control/calls.py`, never by a method's name.

Weights without a shared filesystem (`engine.weights_transport: object_store`): the trainer's rank 0 returns
each version as a `WeightsPayload` (`publish_payload`), which Ray keeps in its object store; the worker of each
engine gets it (Ray moves it to this node) and writes it under a root of its own on this node
(`stage_weights`), which is what its engine is told to load. Initial weights the run wrote itself are handed
to the worker on construction the same way (`initial`): the engine, a restarted one too, and the trainer
start from that node-local copy.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from reference.engine.process import EngineProcess, EngineSpec
from reference.model import load_checkpoint
from reference.tokenizer import Tokenizer
from reference.trainer.batch import Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.handoff import WeightsPayload, prune_local, trainer_payload, write_files, write_payload
from reference.trainer.parallel import DataParallel, init_process_group
from reference.trainer.trainer import StepMetrics, Trainer


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # the resource's name in the policy (R00, T00, ...)
    capabilities: tuple[str, ...]  # capability tags: "rollout" and/or "train"
    cores: tuple[int, ...]  # CPU cores it owns (empty: leave the affinity alone)
    model_dir: str  # the initial weights (a checkpoint directory the engine and the trainer both load)
    seed: int = 0
    max_batch: int = 64  # engine: sequences decoded together
    backend: str = "builtin"  # engine backend
    coalesce_s: float = 0.0  # engine: how long a stream waits after a token for more to send in one line
    weights_local_root: str | None = None  # where this worker writes the weights it is handed (a directory of its
    # own is made in it); None: this node's temporary directory (`ResourceWorker.node_temp_dir`)
    num_threads: int = 0  # torch threads (and the CPUs it asks Ray for) when it owns no cores of its own (on a
    # Ray cluster that it joined, where the cores are Ray's to hand out); 0: one per core in `cores`, at least 1
    logprobs_mode: str = "processed"  # engine: what each token's log-prob is of (reference/engine/backends.py)

    @property
    def threads(self) -> int:
        return self.num_threads or max(1, len(self.cores))

    @property
    def can_roll_out(self) -> bool:
        return "rollout" in self.capabilities


@dataclass(frozen=True)
class WeightsCopy:
    """A version of the weights a worker made available for the engines."""

    version: int
    path: str | None  # its directory (None: a payload left in Ray's object store, written nowhere yet)
    seconds: float  # the worker's time to make it
    bytes: int


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation of a trainer shard's current weights, drawn in-process."""

    reward_mean: float
    exact_match: float  # share of problems answered exactly
    eval_s: float

    def to_metrics(self) -> dict[str, float]:
        """The keys of a held-out evaluation in metrics.jsonl."""
        return asdict(self)


class ResourceWorker:
    def __init__(self, spec: WorkerSpec, initial: dict | None = None) -> None:
        """`initial`: the files of the initial weights' directory (`handoff.read_files`), for a worker whose node
        may not see `spec.model_dir`: written under this worker's own root, and used in its place."""
        self.spec = spec
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)
        self._local: Path | None = None  # this worker's own root for the weights it is handed
        self._staged: list[int] = []  # versions written under it
        self.engine: EngineProcess | None = None
        try:
            if initial is not None:
                local = write_files(initial, self.local_root() / "initial")
                self.spec = spec = dataclasses.replace(spec, model_dir=str(local))
            if spec.can_roll_out:
                self.engine = EngineProcess(
                    EngineSpec(
                        backend=spec.backend,
                        model=spec.model_dir,
                        seed=spec.seed,
                        max_batch=spec.max_batch,
                        torch_threads=spec.threads,
                        coalesce_s=spec.coalesce_s,
                        logprobs_mode=spec.logprobs_mode,
                    )
                )
        except BaseException:  # nothing of a worker that never started stays on its node
            if self._local is not None:
                shutil.rmtree(self._local, ignore_errors=True)
            raise
        self.trainer: Trainer | None = None
        self.tokenizer: Tokenizer | None = None

    # ---- engine ----

    def engine_address(self) -> tuple[str, str] | None:
        """(url, token) of this resource's engine, or None if it cannot roll out."""
        return None if self.engine is None else (self.engine.url, self.engine.token)

    def engine_pid(self) -> int | None:
        return None if self.engine is None else self.engine.pid

    def model_dir(self) -> str:
        """The initial weights' directory as this worker (and its engine) reads it."""
        return self.spec.model_dir

    def engine_weights_dtype(self) -> str | None:
        """The dtype (a torch dtype's name) its engine holds weights in, or None if it cannot roll out."""
        return None if self.engine is None else self.engine.spec.weights_dtype

    def restart_engine(self) -> tuple[str, int]:
        """Replace a dead or hung engine process with a fresh one (same spec, same token): (url, pid).
        It starts from the initial weights; the trajectory manager then loads the resource's version."""
        if self.engine is None:
            raise RuntimeError(f"resource {self.spec.name} has no engine")
        self.engine.restart()
        return self.engine.url, self.engine.pid

    # ---- trainer shard ----

    def init_trainer(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        config: dict,
        checkpoints: str | None,
        resume: str | None,
        parallel: dict | None = None,
    ) -> int:
        """Join the data-parallel group (gloo) and build the trainer from the initial weights, or from the
        checkpoint `resume`; checkpoints go under `checkpoints`. Returns the step it starts at. `parallel`:
        `DataParallel`'s settings (fsdp, param_dtype, activation_checkpointing; the run's `trainer_parallel`).
        With a KL term (`kl_coef` > 0) the trainer gets its reference: a frozen copy of the run's initial
        weights (a resumed run's too), loaded again from `model_dir` and sharded like the policy."""
        settings = dict(parallel or {})
        if world_size > 1 or settings.get("fsdp"):
            init_process_group("gloo", init_method, rank, world_size)
        dp = DataParallel(rank, world_size, **settings)
        self.tokenizer = Tokenizer.load(self.spec.model_dir)  # published versions are complete checkpoints
        cfg = TrainerConfig.from_dict(config)
        reference = None
        if cfg.kl_coef > 0:
            reference = load_checkpoint(self.spec.model_dir)[0].to(torch.float32)
            reference = dp.shard(reference) if dp.fsdp else reference
        if resume is not None:
            self.trainer = Trainer.from_checkpoint(resume, parallel=dp, ref_model=reference, checkpoint_dir=checkpoints)
        else:
            model, tokenizer = load_checkpoint(self.spec.model_dir)
            self.trainer = Trainer(
                model.to(torch.float32),
                cfg,
                pad_id=tokenizer.pad_token_id,
                parallel=dp,
                ref_model=reference,
                checkpoint_dir=checkpoints,
            )
        return self.trainer.step

    def train_step(self, trajectories: list[Trajectory]) -> StepMetrics:
        """One optimiser step on this shard (every shard of the group calls it together)."""
        return self._trainer().train_step(trajectories)

    def evaluate(self, task_name: str, options: dict, seed: int, temperature: float) -> Evaluation:
        """Held-out reward of the current weights: one sample per held-out problem at `temperature` (the rollouts'),
        drawn by this shard's trainer model in-process (so it never competes with rollout for an engine)."""
        from reference.tasks import make_task
        from reference.trainer.probe import evaluate

        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        reward, exact = evaluate(self._trainer().model, make_task(task_name, **options), generator, temperature)
        return Evaluation(reward_mean=reward, exact_match=exact, eval_s=time.perf_counter() - start)

    def publish(self, root: str) -> WeightsCopy | None:
        """Write the current weights as a version directory under `root` (rank 0 writes; the others get None)."""
        start = time.perf_counter()
        handoff = self._trainer().publish(root, self.tokenizer)
        if handoff is None:
            return None
        return WeightsCopy(handoff.version, str(handoff.path), time.perf_counter() - start, handoff.bytes)

    def publish_payload(self, dtype: str) -> tuple[WeightsCopy | None, WeightsPayload | None]:
        """The current weights for the engines, cast to `dtype`: (what `publish` returns, path None; the payload)
        on rank 0, (None, None) on the others (every shard of the group calls it together). Ray stores the two
        separately (`WorkerGroup.call_split`): the caller reads the first and passes the second on unread."""
        start = time.perf_counter()
        payload = trainer_payload(self._trainer(), dtype)
        if payload is None:
            return None, None
        return WeightsCopy(payload.version, None, time.perf_counter() - start, payload.nbytes), payload

    def stage_weights(
        self, version: int, payload: WeightsPayload, keep: list[int] | tuple[int, ...] = ()
    ) -> WeightsCopy:
        """Write version `version` (its payload, fetched to this node) under this worker's own root, for its engine
        to load; keep the newest `handoff.KEEP_LATEST_VERSIONS` written and those of `keep` (the version its engine
        holds: a restarted engine reloads it), remove older ones."""
        start = time.perf_counter()
        if payload.version != version:
            raise ValueError(f"resource {self.spec.name}: a payload of version {payload.version} is not {version}")
        path = write_payload(payload, self.local_root())
        self._staged = prune_local(self.local_root(), [*self._staged, version], keep)
        return WeightsCopy(version, str(path), time.perf_counter() - start, payload.nbytes)

    def staged_versions(self) -> list[int]:
        """The versions written under this worker's own root and kept."""
        return list(self._staged)

    def local_root(self) -> Path:
        """This worker's own directory for the weights it is handed, on its node (made on first use)."""
        if self._local is None:
            base = Path(self.spec.weights_local_root or self.node_temp_dir())
            base.mkdir(parents=True, exist_ok=True)
            self._local = Path(tempfile.mkdtemp(prefix=f"seamlessflow-weights-{self.spec.name}-", dir=base))
        return self._local

    def node_temp_dir(self) -> str:
        """This node's temporary directory (Ray's workers use the Ray node's own: `reference/ray/workers.py`)."""
        return tempfile.gettempdir()

    def save_checkpoint(self, directory: str) -> str:
        return str(self._trainer().save_checkpoint(Path(directory)))

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"resource {self.spec.name} has no trainer shard (init_trainer first)")
        return self.trainer

    def free_address(self, loopback: bool = True) -> str:
        """A `tcp://host:port` on this worker's host for the data-parallel group's rendezvous (rank 0):
        loopback when every worker is on this machine, else the host's address."""
        host = "127.0.0.1" if loopback else socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def ping(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None
