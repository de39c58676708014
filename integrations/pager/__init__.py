"""Page full KV in from ``.kvz`` files (VeriCache's file side) and the verification scheduling model.

* :mod:`~kvz.integrations.pager.sources` — page sources (:class:`KvzSource`, :class:`ArraySource`);
* :mod:`~kvz.integrations.pager.budget` — the memory budget (resident pages, reservations, eviction);
* :mod:`~kvz.integrations.pager.pager` — :class:`KvPager`: prefetch on a worker pool, layer-by-layer loads;
* :mod:`~kvz.integrations.pager.schedule` — the draft/verify scheduling model (Eq. 3, simulation).
"""
from kvz.integrations.pager.budget import kv_bytes
from kvz.integrations.pager.pager import KvPager, PrefetchHandle
from kvz.integrations.pager.schedule import SCENARIOS, AcceptModel, Hardware, eq3_iter_time, full_kv_baseline, simulate
from kvz.integrations.pager.sources import ArraySource, KvzSource

__all__ = ["KvPager", "KvzSource", "ArraySource", "PrefetchHandle", "kv_bytes", "Hardware", "AcceptModel",
           "eq3_iter_time", "full_kv_baseline", "simulate", "SCENARIOS"]
