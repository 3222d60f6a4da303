"""Tandem: a disaggregated prefill/decode LLM serving cluster.

The product's packages sit at the top of the repository (core/, engine/, cache/, ...; see the
layout in README.md) and are imported as ``tandem.core``, ``tandem.engine`` and so on. In a source
checkout (and an editable install) the repository root is added to this package's search path so
that ``tandem.<pkg>`` resolves to ``<root>/<pkg>``; a built wheel installs them under tandem/.
"""

import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "core")) and _root not in __path__:
    __path__.append(_root)
