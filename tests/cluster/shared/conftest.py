"""The modules here only send requests, each through routers of its own over one 1P+1D SmolLM2
(float32) worker set (tests/support/shared_workers.py states what such a module may do). The set
starts with the first module that asks for it and is killed after the last module that uses it:
its workers hold every CPU of ``ray_local``, so it must be gone before another cluster launches."""

from __future__ import annotations

import pytest

from support.lifetimes import used_later

_RUNNING: dict = {}     # namespace -> its WorkerSet, while modules that use it remain


@pytest.fixture(scope="module")
def smollm2_1p1d(request, smollm2, ray_local):
    """The shared 1P+1D of SmolLM2 in float32 (dequantized weights: transformers' numerics); its
    workers export spans to an OTLP receiver on 127.0.0.1 (``.receiver``; None without the
    OpenTelemetry protobufs)."""
    from support.shared_workers import F32_NAMESPACE, WorkerSet

    if F32_NAMESPACE not in _RUNNING:
        try:
            from otlp_support import Receiver
        except ImportError:
            receiver = None
        else:
            receiver = Receiver()
        _RUNNING[F32_NAMESPACE] = WorkerSet(F32_NAMESPACE, smollm2, receiver)
    yield _RUNNING[F32_NAMESPACE]
    if not used_later(request, "smollm2_1p1d"):
        _RUNNING.pop(F32_NAMESPACE).close()
