"""Tool calling at the front door: validation (spec.py), prompt rendering (render.py), output
formats with their parsers and call grammars (formats.py). No model, no torch."""
