"""Mooncake Store as the L3 backend: start a master and a storage client (local processes), or join
a running store by its master's address."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.core.ports import free_port, free_ports

START_ATTEMPTS = 3      # a child that exits at start is started again on fresh ports this often
LOG_TAIL_LINES = 30     # the child's last lines kept (and quoted when it dies)


def parse_kv_store(value: str) -> tuple[str, str | None]:
    """``off`` | ``mooncake`` | ``mooncake://HOST:PORT[/METAPORT]`` -> (mode, address or None)."""
    if value in ("off", "mooncake"):
        return value, None
    if value.startswith("mooncake://") and len(value) > len("mooncake://"):
        return "mooncake", value[len("mooncake://"):]
    raise ValueError(f"--kv-store must be off, mooncake or mooncake://HOST:PORT, got {value!r}")


@dataclass
class MasterAddress:
    host: str
    port: int
    metadata_port: int

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}/{self.metadata_port}"

    @classmethod
    def parse(cls, address: str) -> "MasterAddress":
        """``HOST:PORT[/METAPORT]``; the metadata port defaults to PORT + 1."""
        hostport, _, meta = address.partition("/")
        host, _, port = hostport.rpartition(":")
        return cls(host or "127.0.0.1", int(port), int(meta) if meta else int(port) + 1)


def binary(name: str = "mooncake_master") -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def master_binary() -> str | None:
    return binary("mooncake_master")


class ChildStartError(RuntimeError):
    """A Mooncake child exited or never listened at start; the message quotes its last lines."""


class _Child:
    """A Mooncake binary as a child process whose output is kept, the last :data:`LOG_TAIL_LINES`
    lines of it, by a reader thread (bounded memory over a long run; quoted when it dies at start)."""

    def __init__(self, name: str, args: list[str], ports: tuple[int, ...], ready_s: float):
        path = binary(name)
        if path is None:
            raise RuntimeError(f"{name} not found: pip install 'tandem[mooncake]'")
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.proc = subprocess.Popen([path, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()
        end = time.monotonic() + ready_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                raise ChildStartError(f"{name} exited with {self.proc.returncode} at start "
                                      f"(ports {', '.join(map(str, ports))}); its last lines:\n{self.last_lines()}")
            if set(ports) <= _listening_ports(self.proc.pid):
                return
            time.sleep(0.05)
        self.stop()
        raise ChildStartError(f"{name} not listening on {', '.join(map(str, ports))} within {ready_s}s; "
                              f"its last lines:\n{self.last_lines()}")

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None, "started with stdout=PIPE"
        for line in iter(out.readline, b""):
            self.tail.append(line.decode(errors="replace").rstrip()[:400])
        out.close()

    def last_lines(self) -> str:
        return "\n".join(self.tail) or "(nothing)"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _start_retrying(start, fixed: bool):
    """``start()`` once when its ports are ``fixed``, else up to :data:`START_ATTEMPTS` times, each
    on fresh ports (a port taken between the probe and the child's bind makes it exit at start)."""
    for attempt in range(1 if fixed else START_ATTEMPTS):
        try:
            return start()
        except ChildStartError:
            if fixed or attempt == START_ATTEMPTS - 1:
                raise


class MasterProcess:
    """A ``mooncake_master`` child on free 127.0.0.1 ports, or on ``address``'s (a master restarted
    where a stopped one was, which its clients reconnect to); :meth:`stop` kills it."""

    def __init__(self, host: str = "127.0.0.1", ready_s: float = 20.0, address: MasterAddress | None = None):
        def start() -> tuple[MasterAddress, _Child]:
            port, meta, metrics = free_ports(3, address.host if address else host)
            a = address or MasterAddress(host, port, meta)
            return a, _Child("mooncake_master", [
                f"--port={a.port}", "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={a.metadata_port}",
                f"--metrics_port={metrics}"],  # its default (9003) would clash between masters
                (a.port, a.metadata_port, metrics), ready_s)

        self.address, self.child = _start_retrying(start, fixed=address is not None)

    @property
    def alive(self) -> bool:
        return self.child.alive

    def last_lines(self) -> str:
        return self.child.last_lines()

    def stop(self) -> None:
        self.child.stop()


MIN_SEGMENT_BYTES = 16 << 20    # Mooncake's smallest segment a client may lend


def storage_args(address: MasterAddress, segment_bytes: int, *, host: str, port: int) -> list[str]:
    """``mooncake_client``'s arguments: join ``address`` over TCP, lend ``segment_bytes``, serve its
    RPC on ``host:port`` (k8s/base/kv-store.yaml writes the same flags)."""
    return [f"--master_server_address={address.master}", f"--metadata_server={address.metadata_url}",
            f"--global_segment_size={segment_bytes}", f"--host={host}", f"--port={port}",
            "--protocol=tcp"]


class StorageProcess:
    """A ``mooncake_client`` child that joins the master at ``address`` and lends it
    ``segment_bytes`` (at least :data:`MIN_SEGMENT_BYTES`) of memory: where the store keeps pages
    when the workers lend none. :meth:`stop` kills it, and the pages in its segment go with it."""

    def __init__(self, address: MasterAddress, segment_bytes: int, host: str = "127.0.0.1",
                 ready_s: float = 20.0):
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"a storage segment of {segment_bytes} bytes is under Mooncake's "
                             f"minimum of {MIN_SEGMENT_BYTES}")
        self.segment_bytes = segment_bytes

        def start() -> tuple[int, _Child]:
            port = free_port(host)
            return port, _Child("mooncake_client", storage_args(address, segment_bytes, host=host, port=port),
                                (port,), ready_s)

        self.port, self.child = _start_retrying(start, fixed=False)

    @property
    def alive(self) -> bool:
        return self.child.alive

    def stop(self) -> None:
        self.child.stop()


class LocalStore:
    """A master and (``storage_bytes`` > 0) a :class:`StorageProcess` lending it that much: a
    whole store on 127.0.0.1, which clients join with ``segment_bytes=0``. :meth:`stop` kills both."""

    def __init__(self, storage_bytes: int = 1 << 30, host: str = "127.0.0.1"):
        self.master = MasterProcess(host)
        self.address = self.master.address
        try:
            self.storage = StorageProcess(self.address, storage_bytes, host) if storage_bytes else None
        except BaseException:
            self.master.stop()
            raise

    def stop(self) -> None:
        if self.storage is not None:
            self.storage.stop()
        self.master.stop()


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` itself listens on (a port that answers may be another's)."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def soft_pin(ttl_s: float):
    """Mooncake's put option for a pinned prefix's page: soft-pinned for ``ttl_s`` seconds (the
    master evicts soft-pinned objects only after every other, and keeps them no longer than that)."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    c = ReplicateConfig()
    c.soft_pin_action = SoftPinAction.ENABLE
    c.soft_pin_ttl_ms = max(int(ttl_s * 1000), 1)
    return c


def connect(address: MasterAddress, *, segment_bytes: int = 64 << 20, buffer_bytes: int = 64 << 20,
            local_host: str = "127.0.0.1"):
    """A ``MooncakeDistributedStore`` client that also lends ``segment_bytes`` to the store (0: it
    lends none and only reads and writes pages kept in other clients' segments; else at least
    :data:`MIN_SEGMENT_BYTES`)."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(local_host, address.metadata_url, segment_bytes, buffer_bytes, "tcp", "", address.master)
    if rc != 0:
        raise RuntimeError(f"Mooncake store setup against {address.master} failed: {rc}")
    return s
