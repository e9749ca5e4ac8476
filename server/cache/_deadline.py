"""One call's time, and what each wait inside it may take of it."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["ANSWER_MARGIN_S", "UPLOAD_WAIT_S", "Deadline"]

# How long a hash-only entry waits for another call's upload of the same hash:
# enough for items up to tens of MiB on loopback; a longer upload, or a
# stalled one, costs the waiter a re-send, never a hang.
UPLOAD_WAIT_S = 0.5
# What a call keeps of its time, past waits for uploads and the L2 tier's
# reads, to answer.
ANSWER_MARGIN_S = 0.05


@dataclass(frozen=True)
class Deadline:
    """When a call must have answered, on the monotonic clock (None: never).

    deadline = Deadline.within(context.time_remaining())
    await tier.pull(keys, deadline.budget())
    """

    at: float | None

    @classmethod
    def within(cls, remaining_s: float | None, said_s: float | None = None) -> Deadline:
        """The sooner of the call's remaining time (grpc's) and the time its
        request says it has (a session's batch, whose stream has no deadline)."""
        if said_s is not None:
            remaining_s = said_s if remaining_s is None else min(remaining_s, said_s)
        return cls(None if remaining_s is None else time.monotonic() + remaining_s)

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def budget(self) -> float | None:
        """What a wait may take and leave the call its time to answer."""
        left = self.left()
        return None if left is None else left - ANSWER_MARGIN_S

    def upload_wait(self, said_s: float | None) -> float:
        """How long an entry sent alone waits for another call's upload of it:
        UPLOAD_WAIT_S, or what the client says processing costs it (past that
        it processes), within the budget. Past the wait the entry is simply
        missing and its sender re-sends it: a stalled upload elsewhere never
        holds this call up for long."""
        wait = UPLOAD_WAIT_S if said_s is None else min(UPLOAD_WAIT_S, said_s)
        budget = self.budget()
        return max(0.0, wait if budget is None else min(wait, budget))
