"""``tandem serve`` in a process of its own on 127.0.0.1, for the tests that drive a real server
over HTTP (tests/loadtest/)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from tandem.core.ports import free_port

STARTUP_TIMEOUT_S = 240


class ServeProcess:
    """``tandem serve ARGS --host 127.0.0.1 --port P`` started at once (its model loads while the
    caller does other work); :meth:`url` waits for GET /health and returns the base URL."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "tandem.cluster.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self._healthy = False

    def url(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """The base URL once /health answers 200; AssertionError (with the log's tail) when the
        process exits or ``timeout_s`` passes first."""
        import httpx

        end = time.monotonic() + timeout_s
        while not self._healthy:
            assert self.proc.poll() is None, \
                f"tandem serve exited with {self.proc.returncode}:\n{self.log_path.read_text()[-2000:]}"
            assert time.monotonic() < end, \
                f"tandem serve not healthy after {timeout_s} s:\n{self.log_path.read_text()[-2000:]}"
            with contextlib.suppress(httpx.HTTPError):
                self._healthy = httpx.get(self.base + "/health", timeout=2).status_code == 200
            if not self._healthy:
                time.sleep(0.2)
        return self.base

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
