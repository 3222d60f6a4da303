"""The host side of the L3 prefetch: a bounded staging area and the thread that fills it."""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

log = logging.getLogger(__name__)


class Staging:
    """Values read ahead of their fetch by ``(kind, hash)``, at most ``cap_bytes`` (the oldest dropped
    first), each taken at most once. Thread-safe."""
    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.nbytes = 0
        self._values: OrderedDict[Hashable, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def put(self, ref: Hashable, payload: bytes) -> int:
        """Keep ``payload`` for ``ref``; returns how many values the bound dropped."""
        n = len(payload)
        if n > self.cap_bytes:
            return 1
        dropped = 0
        with self._lock:
            old = self._values.pop(ref, None)
            if old is not None:
                self.nbytes -= len(old)
            while self.nbytes + n > self.cap_bytes:
                _, v = self._values.popitem(last=False)
                self.nbytes -= len(v)
                dropped += 1
            self._values[ref] = payload
            self.nbytes += n
        return dropped

    def take(self, ref: Hashable) -> bytes | None:
        """The payload kept for ``ref``, removed (a staged value is used once), or None."""
        with self._lock:
            v = self._values.pop(ref, None)
            if v is not None:
                self.nbytes -= len(v)
        return v

    def holds(self, refs: Sequence[Hashable]) -> list[bool]:
        """Which of ``refs`` have a value now (a later :meth:`take` may still miss)."""
        with self._lock:
            return [r in self._values for r in refs]

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.nbytes = 0


class Jobs:
    """``run(*job)`` for each submitted job, one at a time, on a daemon thread; never blocks."""

    def __init__(self, run: Callable[..., None], *, max_pending: int, name: str):
        self._run = run
        self._name = name
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: tuple) -> bool:
        """Queue ``job``; False (not queued) when ``max_pending`` wait already, or closed."""
        if self._closed:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    def idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until every submitted job has run; whether they have."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: not q.unfinished_tasks, timeout_s)

    def close(self) -> None:
        """Drop the waiting jobs and end the thread once its running job returns (not waited
        for). Idempotent; later submits are refused."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
        if self._thread is not None:
            self._queue.put_nowait(None)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run(*job)
            except Exception:  # a job's bug must not end the thread (nor reach the engine)
                log.exception("L3 prefetch job failed")
            finally:
                self._queue.task_done()
