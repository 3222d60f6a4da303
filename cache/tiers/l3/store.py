"""A client of a shared KV store for whole pages: batch exists, put, get, each with a timeout."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

log = logging.getLogger(__name__)

DIGEST_BYTES = 16
WRITE_BATCH = 256


def key_prefix(model: str, page_size: int, dtype: str, layout: str) -> str:
    """The namespace of one kind of page: workers share a page only if all four agree."""
    return f"tandem/{model}/p{page_size}/{dtype}/{layout}"


def page_key(prefix: str, page_hash: int, kind: str = "") -> str:
    """A value's key: FULL pages (``kind ""``) at ``PREFIX/HASH``; a component's payload for the
    same page at ``PREFIX/KIND/HASH`` (``swa``: the page's SWA rows; ``mamba``: the recurrent
    state after the page's last token)."""
    h = f"{page_hash & 0xFFFFFFFFFFFFFFFF:016x}"
    return f"{prefix}/{kind}/{h}" if kind else f"{prefix}/{h}"


def seal(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() + payload


def unseal(value: bytes) -> bytes | None:
    """The payload, or None where the digest does not match (a corrupted page)."""
    if len(value) < DIGEST_BYTES:
        return None
    payload = value[DIGEST_BYTES:]
    ok = hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() == value[:DIGEST_BYTES]
    return payload if ok else None


class Backend(Protocol):
    """What the client needs of a store (Mooncake's method names)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def put(self, key: str, value: bytes, *config) -> int: ...    # config: ``pin_config``'s
    def get(self, key: str) -> bytes: ...
    def upsert(self, key: str, value: bytes, *config) -> int: ...   # put, or replace a held value


@dataclass
class L3Stats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0        # pages read whose digest did not match (counted as misses too)
    errors: int = 0
    late: int = 0           # calls cut by the caller's deadline (under half the timeout)
    puts: int = 0
    write_dropped: int = 0  # async writes dropped: queue full, or the store down
    write_skipped: int = 0  # async writes the store already held
    pinned_puts: int = 0    # pages written with an expiry (a pinned prefix's, issue 52)
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class L3Store:
    def __init__(self, backend: Backend | None, prefix: str, *, timeout_s: float = 0.5,
                 backoff_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 max_pending: int = 1024, pin_config: Callable[[float], object] | None = None):
        """``pin_config(ttl_s)``: the backend's put option that keeps a value ``ttl_s`` seconds
        before others are evicted (Mooncake: a soft pin, tiers/l3/mooncake.py ``soft_pin``); None:
        pinned pages are written as any other."""
        self.backend = backend
        self.pin_config = pin_config
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.stats = L3Stats()
        self._clock = clock
        self._down_until = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-store")
        self._pool_lock = threading.Lock()
        self.corrupt_next = False  # the test lever: the next put stores a damaged page
        self.corrupt_all = False   # the test lever: every put stores a damaged page
        self._writes: queue.Queue = queue.Queue(maxsize=max_pending)
        self._writer: threading.Thread | None = None

    @property
    def up(self) -> bool:
        return self.backend is not None and self._clock() >= self._down_until

    def _call(self, fn, *args, budget_s: float | None = None):
        """``fn(*args)`` on the store thread, or None. A failure or the store's timeout marks the
        store down for ``backoff_s``; a call cut by a ``budget_s`` under half the timeout is only a miss."""
        with self._pool_lock:
            if not self.up:
                return None
            pool = self._pool
            fut = pool.submit(fn, *args)
        limit = self.timeout_s if budget_s is None else max(0.0, min(budget_s, self.timeout_s))
        try:
            return fut.result(timeout=limit)
        except FutureTimeout:
            if limit < self.timeout_s / 2:  # the caller's deadline, not a slow store: a miss only
                self.stats.late += 1
                return None
            why = f"timed out after {limit:.3g}s"
        except Exception as e:  # a store error is a miss, never the scheduler's problem
            why = repr(e)
        self.stats.errors += 1
        self._down_until = self._clock() + self.backoff_s
        log.warning("L3 store call %s failed (%s); treated as a miss for %.1fs", getattr(fn, "__name__", fn),
                    why, self.backoff_s)
        if not fut.done():  # a wedged store: abandon the thread, start a fresh one
            self._replace_pool(pool)
        return None

    def _replace_pool(self, pool: ThreadPoolExecutor) -> None:
        with self._pool_lock:
            if self._pool is not pool or self.backend is None:
                return
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-store")

    def exists(self, page_hashes: Sequence[int], kind: str = "") -> list[bool]:
        """Which of the pages the store holds (all False when it is down)."""
        return self.exists_keys([(kind, h) for h in page_hashes])

    def exists_keys(self, refs: Sequence[tuple[str, int]]) -> list[bool]:
        """Which of the ``(kind, page_hash)`` values the store holds, in one batch call (all
        False when it is down)."""
        if not refs:
            return []
        t0 = time.perf_counter()
        backend = self.backend      # read once: close() may clear it from another thread
        got = self._call(backend.batch_is_exist, [page_key(self.prefix, h, k) for k, h in refs]) \
            if backend is not None else None
        self.stats.read_s += time.perf_counter() - t0
        if got is None or len(got) != len(refs):
            return [False] * len(refs)
        return [g == 1 for g in got]

    def leading_hits(self, page_hashes: Sequence[int]) -> int:
        """How many of the first pages the store holds (a chain is usable only up to its first gap)."""
        n = 0
        for hit in self.exists(page_hashes):
            if not hit:
                break
            n += 1
        return n

    def _sealed(self, payload: bytes) -> bytes:
        value = seal(payload)
        if self.corrupt_next or self.corrupt_all:
            self.corrupt_next = False
            value = value[:DIGEST_BYTES] + bytes([value[DIGEST_BYTES] ^ 0xFF]) + value[DIGEST_BYTES + 1:]
        return value

    def put(self, page_hash: int, payload: bytes, kind: str = "") -> bool:
        value = self._sealed(payload)
        key = page_key(self.prefix, page_hash, kind)
        rc = self._call(self.backend.put, key, value) if self.backend else None
        if rc != 0:
            return False
        self.stats.puts += 1
        self.stats.bytes_written += len(payload)
        return True

    def put_async(self, pages: Sequence[tuple[int, bytes]], kind: str = "",
                  pin_ttl_s: float | None = None) -> int:
        """Queue ``(page_hash, payload)`` writes of one kind for the writer thread; returns how many
        were queued, a prefix of ``pages`` (the rest were dropped: the queue is full or
        the store is down). ``pin_ttl_s``: the pages are a pinned prefix's, kept that long (with
        ``pin_config``; a page the store holds already is replaced, with the expiry: ``upsert``)."""
        until = None if pin_ttl_s is None or self.pin_config is None else self._clock() + pin_ttl_s
        if not self.up:
            self.stats.write_dropped += len(pages)
            return 0
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="l3-writer", daemon=True)
            self._writer.start()
        n = 0
        for h, payload in pages:
            try:
                self._writes.put_nowait((page_key(self.prefix, h, kind), self._sealed(payload), len(payload),
                                         until))
                n += 1
            except queue.Full:
                self.stats.write_dropped += len(pages) - n
                break
        return n

    def _write_loop(self) -> None:
        """The writer thread: per batch of queued writes, puts what ``batch_is_exist`` lacks."""
        while True:
            batch = [self._writes.get()]
            while batch[-1] is not None and len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write_batch([b for b in batch if b is not None])
            finally:
                for _ in batch:
                    self._writes.task_done()
            if batch[-1] is None:
                return

    def _write_batch(self, items: list) -> None:
        backend = self.backend
        if not items:
            return
        if backend is None or not self.up:
            self.stats.write_dropped += len(items)
            return
        try:
            held = backend.batch_is_exist([item[0] for item in items])
        except Exception:
            held = [0] * len(items)
        for (key, value, nbytes, until), h in zip(items, held):
            left = None if until is None else until - self._clock()
            if left is not None and left <= 0:
                left = None
            if h == 1 and left is None:
                self.stats.write_skipped += 1
                continue
            if not self.up:
                self.stats.write_dropped += 1
                continue
            try:
                t0 = self._clock()
                if left is None or self.pin_config is None:    # (a pinned write has both)
                    rc = backend.put(key, value)
                else:                       # held unpinned: replaced, with the expiry
                    rc = backend.upsert(key, value, self.pin_config(left))
                    if rc == 0:
                        self.stats.pinned_puts += 1
                if self._clock() - t0 > self.timeout_s:
                    self._down_until = self._clock() + self.backoff_s
                if rc == 0:
                    self.stats.puts += 1
                    self.stats.bytes_written += nbytes
            except Exception as e:
                self.stats.errors += 1
                self._down_until = self._clock() + self.backoff_s
                log.warning("L3 store write failed (%r); writes dropped for %.1fs", e, self.backoff_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (at most ``timeout_s``) until every queued write has been tried."""
        end = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    def get(self, page_hash: int, budget_s: float | None = None, kind: str = "") -> bytes | None:
        """The page's payload, or None (absent, corrupted, store down, or past ``budget_s``)."""
        t0 = time.perf_counter()
        backend = self.backend
        value = (self._call(backend.get, page_key(self.prefix, page_hash, kind), budget_s=budget_s)
                 if backend else None)
        self.stats.read_s += time.perf_counter() - t0
        return self._payload(value)

    def get_many(self, refs: Sequence[tuple[str, int]], budget_s: float | None = None) -> list[bytes | None]:
        """The payloads of ``(kind, page_hash)`` values in one store call, each as :meth:`get`'s."""
        t0 = time.perf_counter()
        backend = self.backend
        keys = [page_key(self.prefix, h, kind) for kind, h in refs]
        values = None
        if backend is not None:
            many = getattr(backend, "get_batch", None) or (lambda ks: [backend.get(k) for k in ks])
            values = self._call(many, keys, budget_s=budget_s)
        self.stats.read_s += time.perf_counter() - t0
        return [self._payload(v) for v in (values or [None] * len(keys))]

    def _payload(self, value) -> bytes | None:
        if not value:
            self.stats.misses += 1
            return None
        payload = unseal(bytes(value))
        if payload is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(payload)
        return payload

    def close(self) -> None:
        """Close the store client (bounded by the timeout; a dead store is not waited for)."""
        if self.backend is None:
            return
        self.flush(self.timeout_s)
        if self._writer is not None:
            try:
                self._writes.put_nowait(None)
            except queue.Full:
                pass
        close = getattr(self.backend, "close", None)
        if close is not None:
            self._call(close)
        with self._pool_lock:
            self.backend = None
            self._pool.shutdown(wait=False, cancel_futures=True)
