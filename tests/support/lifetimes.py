"""Fixture lifetimes that span modules: a heavy object kept from the first module that asks for it
to the last one that uses it (a session fixture would hold it to the end of the session)."""

from __future__ import annotations

import pytest


def used_later(request, name: str) -> bool:
    """Whether a test after the current module's last one (in run order) uses fixture ``name``."""
    items, module = request.session.items, request.node
    last = max(i for i, it in enumerate(items) if it.getparent(pytest.Module) is module)
    return any(name in getattr(it, "fixturenames", ()) for it in items[last + 1:])
