"""The manager's errors: a bad request (an OpenAI-style JSON error body with a 4xx or 5xx status), and a store
that cannot take a write."""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request: becomes an OpenAI-style JSON error with a 4xx status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    def body(self) -> dict:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class StoreError(RuntimeError):
    """The durable store cannot take a write (disk full, locked too long, its files removed or replaced)."""


def store_unavailable(e: StoreError, wrote: bool = True) -> RequestError:
    """The 503 for a request the store failed (`wrote`: the request would have written a record)."""
    then = "nothing was recorded, retry later" if wrote else "retry later"
    return RequestError(f"{e}; {then}", status=503, code="store_unavailable")
