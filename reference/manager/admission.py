"""Admission: what the manager refuses before it spends anything on a request.

Overload is shed, not queued into collapse: agent requests beyond an in-flight limit get a 429 with
Retry-After (most of them as they arrive, from the connection: `connections.py`); the limit adapts to the event
loop's lag (load.py: it falls while the loop lags more than `max_loop_lag_s`, the manager's own CPU being the
bottleneck) up to `max_in_flight_requests`. Request bodies being read or tokenised are capped in bytes
(`max_body_bytes_in_flight`), and a prompt that cannot fit the context is a 400 before it is tokenised (by its
characters) and before it is generated (by its tokens).

`Admission` is a base class of `TrajectoryManager`, so the server keeps calling these on the manager; it uses
the manager's `config`, `tok`, `max_context`, counters (`in_flight`, `body_bytes`, `shed`) and `admission`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from reference.manager.chat import RequestError, Sampling
from reference.manager.load import AdaptiveLimit, LoopLag

if TYPE_CHECKING:
    from reference.manager.config import ManagerConfig
    from reference.tokenizer import Tokenizer


def overloaded(message: str) -> RequestError:
    """The 429 of a request refused for overload: the agent should retry after a second (OpenAI clients do)."""
    return RequestError(message, status=429, code="overloaded", headers={"Retry-After": "1"})


class Admission:
    """The manager's checks before a request is let in (see the module docstring)."""

    config: ManagerConfig
    tok: Tokenizer
    max_context: int | None
    in_flight: int  # agent requests under way
    arriving: int  # agent requests parsed and queued on their connections, their handlers not yet started
    body_bytes: int  # request bodies being read, parsed or tokenised (max_body_bytes_in_flight)
    shed: int  # requests answered 429
    shed_on_arrival: int  # of those, refused from the connection as they arrived (connections.py)
    admission: AdaptiveLimit
    loop_lag: LoopLag

    @property
    def saturated(self) -> bool:
        """Whether agent requests are refused as they arrive: those in flight and those arriving (parsed, their
        handlers not yet started) reach the in-flight limit."""
        return self.in_flight + self.arriving >= self.admission.limit

    def overload_message(self) -> str:
        return (
            f"the manager is at its limit of {self.admission.limit} requests in flight (event loop "
            f"{self.loop_lag.lag_s * 1e3:.0f} ms behind); retry shortly"
        )

    def check_admission(self) -> None:
        """A 429 the agent should retry after a while when the in-flight cap is reached (nothing is held). While
        it is, most agent requests are refused as they arrive, before a request object exists
        (`connections.py`); this catches the rest."""
        if self.in_flight >= self.admission.limit:
            self._shed(self.overload_message())

    def hold_body(self, size: int) -> None:
        """Count `size` bytes of a request body about to be read; 429 when that would pass
        `max_body_bytes_in_flight` (a body is always let in when none is held)."""
        cap = self.config.max_body_bytes_in_flight
        if self.body_bytes and self.body_bytes + size > cap:
            self._shed(
                f"request bodies of {self.body_bytes:,} bytes are being read or tokenised, and this one of "
                f"{size:,} would pass the limit of {cap:,}; retry shortly"
            )
        self.body_bytes += size

    def release_body(self, size: int) -> None:
        self.body_bytes -= size

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Count an agent request in flight; beyond the cap, a 429 the agent should retry after a while."""
        self.check_admission()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def _shed(self, message: str) -> None:
        self.shed += 1
        raise overloaded(message)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise RequestError(
                f"the model {model[:200]!r} does not exist; this server serves {self.config.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_text_length(self, chars: int) -> None:
        """A 400 for a prompt text of `chars` characters that cannot fit the context whatever its tokens (each
        token stands for at most `Tokenizer.max_token_chars` of them), before it is tokenised: tokenising a 7 MiB
        message took seconds and a gigabyte only to learn it was too long."""
        limit, per_token = self.max_context or 0, self.tok.max_token_chars
        if chars // per_token >= limit:
            raise RequestError(
                f"the prompt's {chars:,} characters are at least {chars // per_token:,} tokens (a token is at most "
                f"{per_token} characters); this model's context is {limit} tokens",
                param="messages",
                code="context_length_exceeded",
            )

    def budget(self, prompt_len: int, sampling: Sampling) -> int:
        """max_tokens for a prompt, or a 400 if the prompt and request do not fit the context."""
        limit = self.max_context or 0
        if prompt_len >= limit:
            raise RequestError(
                f"the prompt is {prompt_len} tokens; this model's context is {limit} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if sampling.max_tokens is None:
            return min(self.config.default_max_tokens, limit - prompt_len)
        if prompt_len + sampling.max_tokens > limit:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) exceeds this model's "
                f"context of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return sampling.max_tokens
