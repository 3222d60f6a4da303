"""Mooncake Store as the L3 backend: start a master (a local process), or join one by address.

``mooncake_master`` ships with the PyPI wheel ``mooncake-transfer-engine-non-cuda`` (CPU, TCP);
on an RDMA cluster the same store runs over RDMA. Imported only when a store is configured.
"""

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
    port: int            # the master's RPC port
    metadata_port: int   # its HTTP metadata server

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


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


class MasterProcess:
    """A ``mooncake_master`` child on free 127.0.0.1 ports; :meth:`stop` kills it."""

    def __init__(self, host: str = "127.0.0.1", ready_s: float = 20.0):
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'tandem[mooncake]'")
        self.address = MasterAddress(host, free_port(host), free_port(host))
        self.proc = subprocess.Popen(
            [binary, f"--port={self.address.port}", "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.address.metadata_port}",
             f"--metrics_port={free_port(host)}"],  # its default (9003) would clash between masters
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + ready_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            if all(_listening(host, p) for p in (self.address.port, self.address.metadata_port)):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master not listening within {ready_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def connect(address: MasterAddress, *, segment_bytes: int = 64 << 20, buffer_bytes: int = 64 << 20,
            local_host: str = "127.0.0.1"):
    """A ``MooncakeDistributedStore`` client that also lends ``segment_bytes`` (at least 16 MiB) to the store."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(local_host, address.metadata_url, segment_bytes, buffer_bytes, "tcp", "", address.master)
    if rc != 0:
        raise RuntimeError(f"Mooncake store setup against {address.master} failed: {rc}")
    return s
