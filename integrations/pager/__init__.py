"""Page full KV in from ``.kvz`` files (VeriCache's file side) and the verification scheduling model."""
from kvz.integrations.pager.pager import ArraySource, KvPager, KvzSource, PrefetchHandle, kv_bytes
from kvz.integrations.pager.schedule import SCENARIOS, AcceptModel, Hardware, eq3_iter_time, full_kv_baseline, simulate

__all__ = ["KvPager", "KvzSource", "ArraySource", "PrefetchHandle", "kv_bytes", "Hardware", "AcceptModel",
           "eq3_iter_time", "full_kv_baseline", "simulate", "SCENARIOS"]
