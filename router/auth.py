"""Who is asking: API keys, tenants and roles (``tandem serve --api-keys FILE``), per-tenant rate
limits."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger(__name__)

DEFAULT_TENANT = ""     # no key file, --api-key, or anonymous: the shared namespace


class RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_s: float | None = Field(None, gt=0)


class KeyEntry(BaseModel):
    """One entry of the key file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str | None = Field(None, min_length=8)
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    role: Literal["user", "admin"] = "user"
    rate_limit: RateLimit | None = None
    pin_tokens: int | None = Field(None, ge=0, description="most tokens this tenant may keep pinned per "
                                                          "worker (unset: CacheConfig.pin_share of the pool)")

    @model_validator(mode="after")
    def _one_key(self) -> "KeyEntry":
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("each entry needs exactly one of key, key_sha256")
        return self

    def digest(self) -> bytes:
        return hashlib.sha256(self.key.encode()).digest() if self.key else bytes.fromhex(self.key_sha256 or "")


@dataclass(frozen=True)
class Principal:
    """The caller: its tenant ("" = the default one) and role."""

    tenant: str
    role: str
    pin_tokens: int | None = None   # the key's cap on pinned tokens per worker (None: the worker's share)

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def label(self) -> str:
        """The tenant as a metrics label."""
        return self.tenant or "default"


ANONYMOUS = Principal(DEFAULT_TENANT, "admin")


def load_keys(path: str) -> tuple[list[KeyEntry], dict[str, RateLimit]]:
    """The entries of key file ``path`` and each tenant's rate limit; ValueError naming the entry
    (never its key) when the file is not a valid key list."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: the key file must be a non-empty YAML list of entries")
    entries: list[KeyEntry] = []
    limits: dict[str, RateLimit] = {}
    for i, item in enumerate(raw):
        try:
            e = KeyEntry.model_validate(item)
        except ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'entry'}: {x['msg']}" for x in err.errors())
            raise ValueError(f"{path}: entry {i}: {why}") from None
        if e.rate_limit is not None:
            if limits.get(e.tenant, e.rate_limit) != e.rate_limit:
                raise ValueError(f"{path}: entry {i}: tenant {e.tenant!r} has two different rate limits")
            limits[e.tenant] = e.rate_limit
        entries.append(e)
    return entries, limits


class _Bucket:

    def __init__(self, rate: float):
        self.rate, self.level, self.t = rate, rate, time.monotonic()

    def wait(self, now: float, cost: float) -> float:
        """Seconds until ``cost`` may be taken (0: now, and it was not taken yet)."""
        self.level = min(self.rate, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level >= min(cost, self.rate):
            return 0.0
        return (min(cost, self.rate) - self.level) / self.rate


class KeyRing:
    """The key set in force (module docstring). ``api_key``: the single admin key of --api-key;
    ``path``: the key file (None: none)."""

    def __init__(self, api_key: str | None = None, path: str | None = None):
        self.path = path
        self._admin_key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[RateLimit, _Bucket | None, _Bucket | None]] = {}
        self._keys: tuple[tuple[bytes, Principal], ...] = ()
        self._limits: dict[str, RateLimit] = {}
        if path is not None:
            self._install(*load_keys(path))

    @property
    def open(self) -> bool:
        """No key at all: every caller is :data:`ANONYMOUS`."""
        return self._admin_key is None and self.path is None

    def _install(self, entries: list[KeyEntry], limits: dict[str, RateLimit]) -> None:
        keys = tuple((e.digest(), Principal(e.tenant, e.role, e.pin_tokens)) for e in entries)
        with self._lock:
            self._keys, self._limits = keys, limits

    def reload(self) -> bool:
        """Read the key file again (SIGHUP); whether the new set is in force."""
        if self.path is None:
            return False
        try:
            self._install(*load_keys(self.path))
        except (OSError, ValueError, yaml.YAMLError) as e:
            log.error("api keys: kept the previous key set: %s", str(e)[:300])
            return False
        log.warning("api keys: reloaded %s (%d keys)", self.path, len(self._keys))
        return True

    def who(self, token: str) -> Principal | None:
        """The principal of ``token``, or None (unknown key); constant time in which entry matches."""
        if self.open:
            return ANONYMOUS
        if not token:
            return None
        d = hashlib.sha256(token.encode()).digest()
        found = None
        if self._admin_key is not None and hmac.compare_digest(d, self._admin_key):
            found = ANONYMOUS
        for digest, p in self._keys:
            if hmac.compare_digest(d, digest) and found is None:
                found = p
        return found

    def charge(self, tenant: str, requests: int, tokens: int) -> int:
        """Take ``requests`` and ``tokens`` from ``tenant``'s buckets; 0 when taken, else the whole
        seconds to wait (Retry-After), nothing taken."""
        limit = self._limits.get(tenant)
        if limit is None:
            return 0
        with self._lock:
            got = self._buckets.get(tenant)
            if got is None or got[0] != limit:
                got = self._buckets[tenant] = (
                    limit, _Bucket(limit.requests_per_s) if limit.requests_per_s else None,
                    _Bucket(limit.tokens_per_s) if limit.tokens_per_s else None)
            _, req_b, tok_b = got
            now = time.monotonic()
            waits = [b.wait(now, c) for b, c in ((req_b, requests), (tok_b, tokens)) if b is not None]
            if any(waits):
                return max(1, math.ceil(max(waits)))
            for b, c in ((req_b, requests), (tok_b, tokens)):
                if b is not None:
                    b.level -= c
            return 0
