"""Mooncake Store as the L3 backend: start a master and a storage client (local processes), or join
a running store by its master's address."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


class _Child:

    def __init__(self, name: str, args: list[str], host: str, ports: tuple[int, ...], ready_s: float):
        path = binary(name)
        if path is None:
            raise RuntimeError(f"{name} not found: pip install 'tandem[mooncake]'")
        self.proc = subprocess.Popen([path, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        end = time.monotonic() + ready_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}")
            if all(_listening(host, p) for p in ports):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{name} not listening within {ready_s}s")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class MasterProcess(_Child):
    """A ``mooncake_master`` child on free 127.0.0.1 ports, or on ``address``'s (a master restarted
    where a stopped one was, which its clients reconnect to); :meth:`stop` kills it."""

    def __init__(self, host: str = "127.0.0.1", ready_s: float = 20.0, address: MasterAddress | None = None):
        self.address = address or MasterAddress(host, free_port(host), free_port(host))
        host = self.address.host
        super().__init__("mooncake_master", [
            f"--port={self.address.port}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.address.metadata_port}",
            f"--metrics_port={free_port(host)}"],  # its default (9003) would clash between masters
            host, (self.address.port, self.address.metadata_port), ready_s)


MIN_SEGMENT_BYTES = 16 << 20    # Mooncake's smallest segment a client may lend


def storage_args(address: MasterAddress, segment_bytes: int, *, host: str, port: int) -> list[str]:
    """``mooncake_client``'s arguments: join ``address`` over TCP, lend ``segment_bytes``, serve its
    RPC on ``host:port`` (k8s/base/kv-store.yaml writes the same flags)."""
    return [f"--master_server_address={address.master}", f"--metadata_server={address.metadata_url}",
            f"--global_segment_size={segment_bytes}", f"--host={host}", f"--port={port}",
            "--protocol=tcp"]


class StorageProcess(_Child):
    """A ``mooncake_client`` child that joins the master at ``address`` and lends it
    ``segment_bytes`` (at least :data:`MIN_SEGMENT_BYTES`) of memory: where the store keeps pages
    when the workers lend none. :meth:`stop` kills it, and the pages in its segment go with it."""

    def __init__(self, address: MasterAddress, segment_bytes: int, host: str = "127.0.0.1",
                 ready_s: float = 20.0):
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"a storage segment of {segment_bytes} bytes is under Mooncake's "
                             f"minimum of {MIN_SEGMENT_BYTES}")
        self.segment_bytes = segment_bytes
        self.port = free_port(host)
        super().__init__("mooncake_client", storage_args(address, segment_bytes, host=host, port=self.port),
                         host, (self.port,), ready_s)


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


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


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
