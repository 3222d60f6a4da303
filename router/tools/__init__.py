"""Tool calling at the front door: validation, prompt rendering, output formats with their parsers
and call grammars. No model, no torch."""
