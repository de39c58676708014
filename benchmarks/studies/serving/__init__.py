"""Serving: :mod:`.verify` (draft on a compressed cache, verify on the exact tier, paged in)."""
