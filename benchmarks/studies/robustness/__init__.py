"""Robustness: :mod:`.corruption_sweep` (is every damaged byte of a file detected?)."""
