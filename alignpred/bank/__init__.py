"""Calibration banks: the bank itself (canonical bytes -> sha256 content id), the registry that
finds banks by name or id, and calibration (GPA rotations, ridge prediction maps).

>>> from alignpred.bank import resolve_bank
>>> resolve_bank("gemma-3-270m").model
'gemma-3-270m'
"""
from alignpred.bank.attention_stats import AttentionStats, AttentionStatsError, highrate_gain, waterfill_gain
from alignpred.bank.bank import Bank
from alignpred.bank.calibrate import block_samples, default_groups, default_sources, fit_bank, fit_map
from alignpred.bank.capture_stats import (
                                     CaptureStats,
                                     capture_stats_path,
                                     find_capture_stats,
                                     fit_attention_stats,
                                     tokens_digest,
)
from alignpred.bank.gpa import fit_gpa
from alignpred.bank.registry import (
                                     PACKAGE_DIR,
                                     BankEntry,
                                     BankRegistry,
                                     add,
                                     find,
                                     fitting,
                                     lookup,
                                     missing_bank_error,
                                     registry,
                                     resolve_bank,
                                     search_dirs,
                                     sensitivity,
                                     user_dir,
)

__all__ = ["Bank", "block_samples", "default_groups", "default_sources", "fit_bank", "fit_map", "fit_gpa",
           "PACKAGE_DIR", "BankEntry", "BankRegistry", "add", "find", "fitting", "lookup", "missing_bank_error",
           "registry", "resolve_bank", "search_dirs", "sensitivity", "user_dir",
           "AttentionStats", "AttentionStatsError", "highrate_gain", "waterfill_gain",
           "CaptureStats", "capture_stats_path", "find_capture_stats", "fit_attention_stats", "tokens_digest"]
