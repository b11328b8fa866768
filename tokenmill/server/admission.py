"""Admission control: at most ``capacity`` sequences in the engine, a bounded queue before it.

::

    arrive ──► engine has room and nobody queued? ──yes──► admitted (holds num_seqs slots)
                      │ no
                      ▼
               queue full (requests or prompt tokens)?
                 ├─ no ──► queued in (priority, arrival) order; admitted when slots free up
                 └─ yes ─► a queued request of lower priority (larger value)? shed the lowest,
                           latest one (429) and queue this one; otherwise 429 this one

A queued request that passes its deadline leaves the queue with 503; one whose client goes
away leaves it silently. Everything here runs on the event loop, so no locks.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from dataclasses import dataclass, field


class Rejected(Exception):
    """Not admitted: ``status`` 429 (queue full, shed, tenant limits) or 503 (deadline passed in the queue)."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


@dataclass
class Ticket:
    priority: int
    """Lower is more important (as the engine's priority policy)."""
    num_seqs: int
    """Engine slots the request needs (prompts times n)."""
    num_tokens: int
    """Prompt tokens, counted against the queue's token bound while queued."""
    deadline: float
    """time.monotonic() by which it must be admitted."""
    order: int = 0
    future: asyncio.Future | None = field(default=None, repr=False)
    admitted: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.order)


class AdmissionController:
    def __init__(self, capacity: int, max_queued_requests: int, max_queued_tokens: int, retry_after: float) -> None:
        self.capacity = capacity
        self.max_queued_requests, self.max_queued_tokens = max_queued_requests, max_queued_tokens
        self.retry_after = retry_after
        self.in_engine = 0
        """Slots held by admitted requests."""
        self._queue: list[Ticket] = []  # sorted by key: most important first
        self._queued_tokens = 0
        self._order = itertools.count()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    async def admit(self, ticket: Ticket) -> None:
        """Return once the ticket holds its slots; raise Rejected otherwise. Pair with release()."""
        ticket.order = next(self._order)
        if not self._queue and self.in_engine + ticket.num_seqs <= self.capacity:
            self._take(ticket)
            return
        self._make_room(ticket)
        ticket.future = asyncio.get_running_loop().create_future()
        bisect.insort(self._queue, ticket, key=lambda t: t.key)
        self._queued_tokens += ticket.num_tokens
        try:
            await asyncio.wait_for(asyncio.shield(ticket.future), max(ticket.deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            if ticket.admitted:  # admitted in the same instant the deadline fired
                return
            self._unqueue(ticket)
            raise Rejected(503, "deadline", "the request passed its deadline while queued", self.retry_after)
        except asyncio.CancelledError:  # the client went away
            self._unqueue(ticket)
            if ticket.admitted:
                self.release(ticket)
            raise

    def release(self, ticket: Ticket) -> None:
        """Give back an admitted ticket's slots and admit whoever fits next; idempotent."""
        if ticket.admitted:
            ticket.admitted = False
            self.in_engine -= ticket.num_seqs
            self._dispatch()

    def _take(self, ticket: Ticket) -> None:
        ticket.admitted = True
        self.in_engine += ticket.num_seqs

    def _make_room(self, ticket: Ticket) -> None:
        def full() -> bool:
            return (len(self._queue) >= self.max_queued_requests
                    or (self._queue and self._queued_tokens + ticket.num_tokens > self.max_queued_tokens))

        while full():
            worst = self._queue[-1] if self._queue else None
            if worst is None or worst.priority <= ticket.priority:
                reason = "queue_full" if len(self._queue) >= self.max_queued_requests else "queue_tokens"
                raise Rejected(429, reason, f"the server is at capacity ({len(self._queue)} requests, "
                               f"{self._queued_tokens} prompt tokens queued); retry later", self.retry_after)
            self._unqueue(worst)
            worst.future.set_exception(Rejected(429, "shed", "shed for higher-priority work under overload; "
                                                "retry later", self.retry_after))

    def _unqueue(self, ticket: Ticket) -> None:
        if ticket in self._queue:
            self._queue.remove(ticket)
            self._queued_tokens -= ticket.num_tokens

    def _dispatch(self) -> None:
        """Admit queued tickets in order while the head fits (strict priority: no overtaking)."""
        while self._queue and self.in_engine + self._queue[0].num_seqs <= self.capacity:
            ticket = self._queue.pop(0)
            self._queued_tokens -= ticket.num_tokens
            if ticket.future.done():
                continue
            self._take(ticket)
            ticket.future.set_result(None)
