"""A paged engine's KV blocks as a closed-form function of its decode step (sim/engine.py's paged mode).

Within a stretch where the batch does not change every decoding request's context grows by one token a step,
so the blocks the batch needs at any later step follow from a histogram of the requests' offsets within a
block: the engine asks for the first step short of blocks once per stretch, instead of counting every step.
"""

from __future__ import annotations

import sys

NEVER = sys.maxsize


class BlockLedger:
    """The KV blocks a paged engine's admitted requests need, as a function of the engine's step.

    For the step that starts at engine step s, a decoding request whose context is offset + s tokens
    needs ceil((offset + s + 1) / bs) blocks (its context and the token the step appends). Writing
    offset = a * bs + rho with 0 <= rho < bs, that is a + 1 + (rho + s) // bs, so all of them need

        base + sum over rho of hist[rho] * ((rho + s) // bs)

    where hist counts decoding requests by rho and `base` holds everything constant in s: each
    decoding request's a + 1, the blocks of requests still prefilling, and shared prompt blocks
    (counted once, and subtracted from each request that uses them). With s = m * bs + t the sum is
    decoding * m + (requests with rho >= bs - t): O(bs) a query, O(1) an update."""

    def __init__(self, capacity: int, block_tokens: int) -> None:
        self.capacity, self.bs = capacity, block_tokens
        self.base = 0
        self.hist = [0] * block_tokens
        self.decoding = 0

    def add_decoding(self, offset: int, shared: int, sign: int = 1) -> None:
        """A request decoding from context offset + step; it uses `shared` blocks it does not hold."""
        a, rho = divmod(offset, self.bs)
        self.base += sign * (a + 1 - shared)
        self.hist[rho] += sign
        self.decoding += sign

    def needed(self, step: int) -> int:
        """Blocks the step that starts at `step` needs."""
        m, t = divmod(step, self.bs)
        return self.base + self.decoding * m + (sum(self.hist[self.bs - t :]) if t else 0)

    def first_overflow(self, step: int, limit: int = NEVER) -> int:
        """The first step >= `step` that needs more blocks than the cache holds (NEVER if none), or a
        step >= `limit` before which none does."""
        if not self.decoding:
            return step if self.base > self.capacity else NEVER
        m, spare = divmod(self.capacity - self.base, self.decoding)  # decoding * m <= free < ... * (m + 1)
        if m * self.bs >= limit:  # every step before block round m fits
            return max(step, m * self.bs)
        over = 0  # step m * bs + t needs decoding * m + (requests with rho >= bs - t) over base
        for t in range(1, self.bs):
            over += self.hist[self.bs - t]
            if over > spare:
                return max(step, m * self.bs + t)
        return max(step, (m + 1) * self.bs)

    @property
    def empty(self) -> bool:
        return self.base == 0 and self.decoding == 0
