"""The trajectory manager's settings (`ManagerConfig`): limits, timeouts, the admin token and the names web pages
may use. Its own module so that the manager's parts (admission, generation, fleet) can name it without importing
the manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.manager.sessions import MemoryBudget


@dataclass(frozen=True)
class ManagerConfig:
    model_name: str = "seamlessflow-tiny"
    default_max_tokens: int = 1024  # when a request names none (further capped by the context)
    max_body_bytes: int = 8 << 20
    max_engine_attempts: int = 3  # engines tried for one request before answering 503
    affinity_slack: int = 2
    engine_cooldown_s: float = 5.0  # a failed engine is skipped this long, doubling with each failure in a row
    engine_max_cooldown_s: float = 300.0
    max_sessions_in_memory: int = 10_000  # idle sessions beyond this leave memory (the store keeps them)
    max_tokens_in_memory: int = 16_000_000  # tokens all sessions in memory may hold together
    max_session_tokens_in_memory: int = 2_000_000  # an idle session holding more leaves memory
    max_in_flight_requests: int = 4096  # agent requests at once; beyond it 429 (0: no cap)
    body_timeout_s: float = 30.0  # an agent request's body must arrive within this (408 after); until it has, the
    # request holds no in-flight slot, so connections that never send theirs do not lock agents out
    max_body_bytes_in_flight: int = 64 << 20  # request bodies being read, parsed or tokenised at once (their
    # Content-Length; all connections); a body beyond it gets 429 before anything of it is read
    durable_within_s: float = 10.0  # a request whose record is not durable in the store within this gets 503 (a
    # stalled disk); the record is kept when the write completes
    idle_timeout_s: float = 75.0  # a connection with no request under way (its headers not all in) closes after
    # this (nginx's keep-alive timeout); aiohttp's default was an hour, so idle and half-sent requests piled up
    max_loop_lag_s: float = 0.1  # the in-flight limit falls while the event loop lags more than this (0: fixed)
    max_pause_s: float = 900.0  # a pause not resumed within this is resumed by the manager (0: never)
    engine_wait_s: float = 600.0  # a request waits this long for an engine while all are out of service
    admin_token: str | None = None  # when set, everything but the agents' /s/<session>/v1 calls needs it
    # Web pages: a request's Host must be a loopback name or an IP address, or one of these (a page that rebinds
    # its own name to this machine names itself); a browser's Origin must be this server's, or one of these.
    # "*" allows any.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "default_max_tokens",
            "max_engine_attempts",
            "max_sessions_in_memory",
            "max_tokens_in_memory",
            "max_session_tokens_in_memory",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0 or not self.durable_within_s > 0:
            raise ValueError(
                f"idle_timeout_s and durable_within_s must be > 0, got {self.idle_timeout_s} and "
                f"{self.durable_within_s}"
            )
        if not self.body_timeout_s > 0 or self.max_body_bytes_in_flight < 1:
            raise ValueError(
                f"body_timeout_s must be > 0 and max_body_bytes_in_flight >= 1, got "
                f"{self.body_timeout_s} and {self.max_body_bytes_in_flight}"
            )
        for name in ("max_in_flight_requests", "max_pause_s", "engine_cooldown_s", "max_loop_lag_s", "engine_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin_token must not be empty (use None for no token)")
        for name in ("allowed_hosts", "allowed_origins"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v.strip() for v in values):
                raise ValueError(f"{name} must be a list of non-empty names, got {values!r}")

    def budget(self) -> MemoryBudget:
        return MemoryBudget(self.max_sessions_in_memory, self.max_tokens_in_memory, self.max_session_tokens_in_memory)
