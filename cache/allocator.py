"""Slot allocators over a paged KV pool."""

from __future__ import annotations

import torch


class SlotError(RuntimeError):
    """Misuse of the allocator: a double free or a slot that does not belong to this pool."""


class PagedAllocator:
    """Free list of pages. With ``page_size == 1`` it is a plain token-slot allocator."""

    def __init__(self, num_pages: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.clear()

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool)

    def available_size(self) -> int:
        """Free slots (tokens), counting frees not yet merged."""
        return (len(self._free_pages) + sum(len(r) for r in self._released)) * self.page_size

    def available_pages(self) -> int:
        return len(self._free_pages) + sum(len(r) for r in self._released)

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def allocated_pages(self) -> torch.Tensor:
        return torch.nonzero(self._allocated, as_tuple=False).flatten()

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > len(self._free_pages) and self._released:
            self._free_pages = torch.sort(torch.cat([self._free_pages, *self._released])).values
            self._released = []
        if n > len(self._free_pages):
            return None
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        self._allocated[pages] = True
        return pages

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """``n_pages`` whole pages (page ids), or None."""
        if n_pages == 0:
            return torch.empty(0, dtype=torch.int64)
        return self._take_pages(n_pages)

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Slots for ``n_tokens`` starting on a fresh page (the last page's tail stays the caller's until
        freed): ``[n_tokens]`` int64 slot ids, or None when there is no room."""
        return self.alloc_extend(last_loc=-1, prefix_len=0, n_tokens=n_tokens)

    def alloc_extend(self, last_loc: int, prefix_len: int, n_tokens: int) -> torch.Tensor | None:
        """Slots for positions ``prefix_len.. prefix_len + n_tokens - 1`` of one request."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens={n_tokens} must be >= 0")
        ps = self.page_size
        in_page = 0 if prefix_len % ps == 0 else min(ps - prefix_len % ps, n_tokens)
        if in_page and last_loc <= 0:
            raise SlotError(f"prefix_len={prefix_len} is not page-aligned but last_loc={last_loc}")
        need_pages = -(-(n_tokens - in_page) // ps)
        pages = self._take_pages(need_pages) if need_pages else torch.empty(0, dtype=torch.int64)
        if pages is None:
            return None
        head = torch.arange(last_loc + 1, last_loc + 1 + in_page, dtype=torch.int64)
        body = (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)[None, :]).flatten()
        return torch.cat([head, body[: n_tokens - in_page]])

    def free(self, slots: torch.Tensor) -> None:
        """Release the pages holding ``slots`` (int tensor of slot ids). Raises SlotError on misuse."""
        if slots.numel() == 0:
            return
        slots = slots.to(device="cpu", dtype=torch.int64).flatten()
        lo, hi = int(slots.min()), int(slots.max())
        if lo < self.page_size or hi >= (self.num_pages + 1) * self.page_size:
            bad = lo if lo < self.page_size else hi
            raise SlotError(
                f"slot {bad} does not belong to this pool (valid slots {self.page_size}.."
                f"{(self.num_pages + 1) * self.page_size - 1}; page 0 is reserved)")
        pages = torch.unique(slots // self.page_size) if self.page_size > 1 else slots
        if self.page_size == 1 and len(torch.unique(pages)) != len(pages):
            dup = _first_duplicate(pages)
            raise SlotError(f"double free of slot {dup}: listed twice in one free() call")
        held = self._allocated[pages]
        if not bool(held.all()):
            page = int(pages[~held][0])
            raise SlotError(
                f"double free of slot {page * self.page_size} (page {page}): it is not allocated")
        self._allocated[pages] = False
        self._released.append(pages.clone())


def _first_duplicate(x: torch.Tensor) -> int:
    seen: set[int] = set()
    for v in x.tolist():
        if v in seen:
            return v
        seen.add(v)
    return -1
