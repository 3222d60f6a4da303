"""Tandem's import root: ``tandem.<pkg>`` resolves to the repository's ``<pkg>/`` in a checkout.

Importing it caps oneDNN's instruction set first (core/onednn.py): that has to happen before
the process runs any oneDNN primitive, and every Tandem process imports this module first."""

import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "core")) and _root not in __path__:
    __path__.append(_root)

from tandem.core.onednn import pin_onednn_isa as _pin  # noqa: E402

_pin()
