"""What the engine tests share: waiting on a condition with a deadline inside an event loop."""

from __future__ import annotations

import asyncio
import inspect

import pytest


async def until(condition, timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Return once `condition()` is true (it may return an awaitable: an engine's `stats()`), polled every few
    milliseconds; after `timeout_s`, fail the test naming `what`. Never a fixed sleep followed by an assert."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                value = condition()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


@pytest.fixture(scope="session")
def eventually():
    """`await eventually(condition, timeout_s=30, what=...)`: `until`, for a test's event loop."""
    return until
