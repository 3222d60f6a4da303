"""The model forward and the engine around it (see README.md)."""
