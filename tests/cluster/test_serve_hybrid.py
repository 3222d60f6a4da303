"""``tandem serve --model PATH`` for both hybrid families, as a user runs it: the real command
line in a child process, colocated and disaggregated (Ray: 1 prefill + 1 decode actor, NIXL),
a host tier on. The startup lines name the cache components and pool sizes; greedy tokens over
HTTP equal the in-process engine's, and a second turn of the session is served from the decode
worker's prefix cache (``cached_tokens`` counts only prefill's hits, so the check is the
tokens)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tandem.core.ports import free_port  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

from hf_hybrid_support import hybrid_engine_config, tiny_family  # noqa: E402

FLAGS = ["--threads", "1", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "1024",
         "--max-running-requests", "4", "--chunked-prefill-size", "16", "--host-pool-tokens", "512",
         "--dtype", "float32"]   # the oracle below is an in-process float32 engine
TURN1 = list(b"A user asks the hybrid model a question that is longer than its window: ")
MAX_TOKENS = 8


def _port() -> int:
    return free_port()          # outside the ephemeral range (core/ports.py)


class Serve:
    """``tandem serve`` in a child process; ``lines``: what it printed (read in a thread)."""

    def __init__(self, model: str, mode: str, timeout: float = 120.0):
        for attempt in range(3):   # a free port can be taken (by Ray) before the child binds it
            try:
                self._start(model, mode, timeout)
                return
            except AssertionError as e:
                if "address already in use" not in str(e) or attempt == 2:
                    raise
                self.stop()

    def _start(self, model: str, mode: str, timeout: float) -> None:
        self.port = _port()
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", model, "--mode", mode,
               "--port", str(self.port), *FLAGS]
        if mode == "disaggregated":
            cmd += ["--prefill", "1", "--decode", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "RAY_DEDUP_LOGS": "0"})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for(lambda: any(ln.startswith("tandem: serving") for ln in self.lines), timeout)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = Path(model).name
        self.wait_for(self._listening, 30)   # "serving" is printed just before uvicorn binds

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, cond, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None and not cond():
                raise AssertionError(f"tandem serve exited: {''.join(self.lines)[-3000:]}")
            assert time.monotonic() < end, f"timed out: {''.join(self.lines)[-3000:]}"
            time.sleep(0.05)

    def complete(self, ids: list[int]) -> str:
        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": self.model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module", params=["gemma3", "granite"])
def family(request, tmp_path_factory):
    path, loaded = tiny_family(request.param, tmp_path_factory, "serve_")
    e = Engine(hybrid_engine_config(page_size=4), loaded=loaded)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        t1 = e.generate(TURN1, params)
        turn2 = TURN1 + t1.token_ids + list(b" and then?")
        t2 = e.generate(turn2, params)
    finally:
        e.shutdown()
    return request.param, str(path), [(TURN1, t1.text), (turn2, t2.text)]


def test_tandem_serve_model_path(family):
    """Gemma 3 colocated, Granite-4.0-H disaggregated (both families run 1P+1D over real NIXL in
    tests/worker/test_hybrid_workers.py; here the command line and its startup lines)."""
    name, path, turns = family
    mode = "colocated" if name == "gemma3" else "disaggregated"
    s = Serve(path, mode)
    try:
        want = 2 if mode == "disaggregated" else 1     # Ray forwards the actors' lines later
        s.wait_for(lambda: sum("components" in ln for ln in s.lines) >= want, 30)
        out = "".join(s.lines)
        comp = "full+swa" if name == "gemma3" else "full+mamba"
        pools = [ln for ln in s.lines if "components" in ln]    # each engine's startup line
        assert pools and all(f"components {comp}:" in ln for ln in pools), out
        host = "swa 512 rows" if name == "gemma3" else "mamba 10 rows"
        assert all(f"host {host}" in ln and "host KV pool 512 tokens" in ln for ln in pools), out
        assert ("window 8" in out) == (name == "gemma3") and ("state slots" in out) == (name == "granite")
        if mode == "disaggregated":   # the Ray actors' lines, forwarded to the driver
            assert len(pools) == 2 and any("prefill-0:" in ln for ln in pools) \
                and any("decode-0:" in ln for ln in pools), out
        for ids, text in turns:
            assert s.complete(ids) == text
    finally:
        s.stop()
