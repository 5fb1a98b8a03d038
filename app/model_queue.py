"""The model's queue: one user at a time, served in arrival order, with a bound on how many wait.

Every generation takes a place (`join`) and waits for its turn (`wait`): the page's replies and the OpenAI API's
requests alike (app/engine.py holds the model through this lock). Whoever joined first gets the model next; a full
queue refuses at once (`QueueFull`, with a retry estimate); a place whose client left is given up (`withdraw`), so
that request never runs. Idle work takes the model only when it is free and nobody waits (`acquire(blocking=False)`).

Drop-in for `threading.Lock` where the engine uses one: `acquire(blocking, timeout)`, `release`, `locked`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

MAX_WAITING = 32  # generations waiting for the model at most (besides the one running)


class EngineBusy(RuntimeError):
    """The model could not be had: waited too long, or the queue is full (app.engine raises it too)."""


class QueueFull(EngineBusy):
    def __init__(self, waiting: int, retry_after_s: int):
        self.waiting, self.retry_after_s = waiting, retry_after_s
        super().__init__(f"the model's queue is full ({waiting} generations waiting); try again in about "
                         f"{retry_after_s} s")  # fmt: skip


class Withdrawn(RuntimeError):
    """The place was given up before its turn (its client left): the generation never ran."""


class Ticket:
    """A place in the queue, from `join` until its turn comes (then the lock is held) or it is withdrawn."""

    __slots__ = ("joined", "withdrawn")

    def __init__(self):
        self.joined, self.withdrawn = time.monotonic(), False


class FairLock:
    def __init__(self, max_waiting: int = MAX_WAITING):
        self.max_waiting = max_waiting
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Ticket] = deque()  # waiting, in arrival order
        self._held_since: float | None = None  # monotonic time the holder took the model; None = free
        self._timed = False  # the holder came through the queue (its hold counts for the retry estimate)
        self._holds: deque[float] = deque(maxlen=20)  # seconds of the last generations' holds

    # the queue -------------------------------------------------------------------------------------------
    def join(self) -> Ticket:
        """A place at the end of the queue, now; raises QueueFull when `max_waiting` wait already."""
        with self._cond:
            if len(self._queue) >= self.max_waiting:
                raise QueueFull(len(self._queue), self._retry_after())
            ticket = Ticket()
            self._queue.append(ticket)
            return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None) -> bool:
        """Block until `ticket` is first and the model is free, then hold it (True). False after `timeout` seconds
        (the place is given up); raises Withdrawn if it was withdrawn meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if ticket.withdrawn:
                    raise Withdrawn("the request was withdrawn before its turn")
                if self._held_since is None and self._queue and self._queue[0] is ticket:
                    self._queue.popleft()
                    self._held_since, self._timed = time.monotonic(), True
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._remove(ticket)
                    return False
                self._cond.wait(remaining)

    def withdraw(self, ticket: Ticket) -> None:
        """Give up `ticket`'s place (no-op once its turn came): its `wait` raises Withdrawn, the ones behind move up."""
        with self._cond:
            ticket.withdrawn = True
            self._remove(ticket)

    def _remove(self, ticket: Ticket) -> None:
        try:
            self._queue.remove(ticket)
        except ValueError:
            return
        self._cond.notify_all()

    # threading.Lock's interface --------------------------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Not blocking: the model only if it is free and nobody waits. Blocking: a place at the end of the queue
        (QueueFull when full), then its turn (False after `timeout` seconds; -1 = no limit)."""
        if not blocking:
            with self._cond:
                if self._held_since is not None or self._queue:
                    return False
                self._held_since, self._timed = time.monotonic(), False
                return True
        return self.wait(self.join(), None if timeout is None or timeout < 0 else timeout)

    def release(self) -> None:
        with self._cond:
            if self._held_since is None:
                raise RuntimeError("release of a FairLock that is not held")
            if self._timed:
                self._holds.append(time.monotonic() - self._held_since)
            self._held_since = None
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._held_since is not None

    # figures ---------------------------------------------------------------------------------------------
    def waiting(self) -> int:
        return len(self._queue)

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: the mean of the last holds times those ahead (at least 1)."""
        mean = sum(self._holds) / len(self._holds) if self._holds else 1.0
        return max(1, min(600, math.ceil(mean * (len(self._queue) + 1))))
