"""Tandem's import root: ``tandem.<pkg>`` resolves to the repository's ``<pkg>/`` in a checkout."""

import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "core")) and _root not in __path__:
    __path__.append(_root)
