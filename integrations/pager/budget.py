"""The pager's memory budget: resident pages (LRU) plus reservations for decodes in flight.

``resident_bytes + reserved_bytes <= budget_bytes`` always (``peak_bytes`` records the maximum).
A reservation is taken before a decode starts, evicting least-recently-used pages nobody is
reading (pinned pages are never evicted); a reservation that cannot be met is refused, and the
caller decodes *direct* instead. :class:`PageBudget` is not thread-safe by itself: the pager calls
it with its own lock held.
"""
from __future__ import annotations

from collections import OrderedDict

from alignpred.cache import numpy_dtype

__all__ = ["kv_bytes", "page_bytes", "Page", "Slot", "PageBudget"]


def kv_bytes(layout, n_tokens: int | None = None, layers=None) -> int:
    """Bytes of the dense K/V (keys + values) of ``n_tokens`` positions of ``layers`` (default: all)."""
    n = layout.n_tokens if n_tokens is None else int(n_tokens)
    nl = layout.num_layers if layers is None else len(list(layers))
    return 2 * nl * layout.kv_heads * n * layout.head_dim * numpy_dtype(layout.dtype).itemsize


def page_bytes(src, j: int) -> int:
    """Bytes of page ``j`` (object ``j`` of one layer, keys and values) of the source ``src``."""
    lay, S = src.layout, src.object_size
    return kv_bytes(lay, min(S, lay.n_tokens - j * S), [0])


class Page:
    """A decoded page: keys and values ``[kv_heads, rows, head_dim]``; ``pins`` loads are reading it."""
    __slots__ = ("k", "v", "nbytes", "pins")

    def __init__(self, k, v, pins=0):
        self.k, self.v = k, v
        self.nbytes = k.nbytes + v.nbytes
        self.pins = pins


class Slot:
    """A page being decoded: its reserved bytes, the loaders waiting for it, and its outcome."""
    __slots__ = ("nbytes", "pins", "done", "error")

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.pins = 0
        self.done = False
        self.error = None


class PageBudget:
    """Resident pages by key (``pages``, oldest first) and reserved bytes under ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.pages: OrderedDict = OrderedDict()  # page key -> Page, LRU order
        self.resident_bytes = 0
        self.reserved_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes + self.reserved_bytes)

    def reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` for a decode, evicting unpinned pages (oldest first) as needed;
        False (nothing evicted) when even that would not make room."""
        need = self.resident_bytes + self.reserved_bytes + nbytes - self.budget_bytes
        if need > 0:
            victims, freed = [], 0
            for pk, pg in self.pages.items():  # oldest first
                if pg.pins == 0:
                    victims.append(pk)
                    freed += pg.nbytes
                    if freed >= need:
                        break
            if freed < need:
                return False
            for pk in victims:
                self.resident_bytes -= self.pages.pop(pk).nbytes
            self.evictions += len(victims)
        self.reserved_bytes += nbytes
        self._peak()
        return True

    def unreserve(self, nbytes: int) -> None:
        """A decode finished or failed: its reservation is returned."""
        self.reserved_bytes -= nbytes

    def admit(self, pk, page: Page) -> None:
        """Make ``page`` resident under ``pk`` (most recently used)."""
        self.pages[pk] = page
        self.pages.move_to_end(pk)
        self.resident_bytes += page.nbytes
        self._peak()

    def touch(self, pk) -> Page | None:
        """The resident page ``pk`` (marked most recently used), or None."""
        pg = self.pages.get(pk)
        if pg is not None:
            self.pages.move_to_end(pk)
        return pg

    def forget(self, owner) -> None:
        """Drop the unpinned resident pages whose key starts with ``owner``."""
        for pk in [pk for pk, pg in self.pages.items() if pk[0] == owner and pg.pins == 0]:
            self.resident_bytes -= self.pages.pop(pk).nbytes

    def reset_peak(self) -> None:
        self.evictions = 0
        self.peak_bytes = self.resident_bytes + self.reserved_bytes
