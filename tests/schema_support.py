"""Seeded random JSON schemas whose every valid instance is short (so a real model decoding under
one always finishes within a small ``max_tokens``): nested objects, arrays, enums, consts, bounded
integers and numbers, patterns, anyOf, required fields. Shared by the engine and serving tests."""

from __future__ import annotations

import random


def bounded_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "const"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    k = rng.choice(kinds)
    if k == "string":
        if rng.random() < 0.3:
            return {"type": "string", "pattern": rng.choice([r"^[a-z]{1,6}$", r"^[A-Z][a-z]{0,4}-\d{2}$", r"^\d{3}$"])}
        hi = rng.randint(1, 8)
        return {"type": "string", "minLength": rng.randint(0, hi), "maxLength": hi}
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if k == "number":    # an integer-valued number keeps its text short
        return {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 1}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b", "ünï"], rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": bounded_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if k == "anyOf":
        return {"anyOf": [bounded_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["id", "name", "tags", "items", "meta", "score", "ok", "kind"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: bounded_schema(rng, depth + 1) for n in names},
            "additionalProperties": False, "required": [n for n in names if rng.random() < 0.7]}


def object_schema(seed: int) -> dict:
    """A bounded schema with an object at the top (what response_format asks for)."""
    rng = random.Random(seed)
    inner = bounded_schema(rng)
    if inner.get("type") == "object":
        return inner
    return {"type": "object", "properties": {"root": inner}, "required": ["root"], "additionalProperties": False}
