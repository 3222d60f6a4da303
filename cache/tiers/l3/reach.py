"""How deep an L3 match may end: the components' vote, over what the device and the store hold."""

from __future__ import annotations

from dataclasses import dataclass, field

FULL = -1   # the component index of FULL pages in a ref ``(component, page)``


@dataclass
class Rule:
    """One auxiliary component's rule: ``per_token`` data with a ``span`` (tokens before the end),
    or one value at the end (``per_token`` False)."""

    per_token: bool
    span: int = 1
    on_device: list[bool] = field(default_factory=list)
    stored: dict[int, bool] = field(default_factory=dict)


class Reach:
    """Availability of pages ``[s0, P)`` (FULL) and the rules' data; the deepest end they allow."""

    def __init__(self, page_size: int, s0: int, full_stored: list[bool], rules: list[Rule]):
        self.ps = page_size
        self.s0 = s0
        self.P = s0 + len(full_stored)
        self.full = list(full_stored)
        self.rules = rules

    def window(self, rule: Rule, e: int) -> range:
        """Pages a per-token rule needs for an end after page ``e - 1``."""
        return range(max(0, (e * self.ps - rule.span) // self.ps), e)

    def _has(self, rule: Rule, p: int) -> bool:
        return (p < self.s0 and rule.on_device[p]) or rule.stored.get(p, False)

    def accepts(self, e: int) -> bool:
        """Every rule accepts the boundary after page ``e - 1`` (FULL pages not checked)."""
        for r in self.rules:
            if r.per_token:
                if not all(self._has(r, p) for p in self.window(r, e)):
                    return False
            elif not r.stored.get(e - 1, False):
                return False
        return True

    def deepest(self) -> int:
        """The deepest accepted end ``e`` (``s0``: none past the device match)."""
        run = next((k for k, ok in enumerate(self.full) if not ok), len(self.full))
        for e in range(self.s0 + run, self.s0, -1):
            if self.accepts(e):
                return e
        return self.s0

    def needs(self, e: int) -> list[tuple[int, int]]:
        """Refs ``(component index, page)`` to read for end ``e``: the rules' stored data
        first (a few small values), then FULL pages ``[s0, e)`` in order (``FULL`` = -1)."""
        out = []
        for j, r in enumerate(self.rules):
            if r.per_token:
                out += [(j, p) for p in self.window(r, e) if not (p < self.s0 and r.on_device[p])]
            else:
                out.append((j, e - 1))
        return out + [(FULL, p) for p in range(self.s0, e)]

    def lose(self, ref: tuple[int, int]) -> None:
        """``ref`` could not be read (absent, corrupt, wrong size, late): it is unavailable."""
        j, p = ref
        if j == FULL:
            self.full[p - self.s0] = False
        else:
            self.rules[j].stored[p] = False

    def keep_only(self, read: set) -> None:
        """The deadline passed: only what was read counts (the next :meth:`deepest` needs no read)."""
        for k in range(len(self.full)):
            if (FULL, self.s0 + k) not in read:
                self.full[k] = False
        for j, r in enumerate(self.rules):
            for p in list(r.stored):
                if (j, p) not in read:
                    r.stored[p] = False
