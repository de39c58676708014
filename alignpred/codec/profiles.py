"""Speed profiles: named trade-offs between file size and decode speed.

A profile is a choice of entropy coder and predictors, applied on top of a
:class:`~alignpred.codec.config.CodecConfig`; every one meets the same error budget (the step
search does not change), so they differ only in bits and decode time. The file records the coder
and the config as always, so a reader needs nothing else: a profile never appears in a header.

==========  =================  ============
profile     entropy coder      linear maps
==========  =================  ============
default     ``rans4``          yes
balanced    ``lanes32`` (1.2)  yes
fast        ``lanes32`` (1.2)  no
==========  =================  ============

What each costs in bits and buys in decode speed, per CPU, is measured by ``python -m
kvz.benchmarks.speed`` into ``benchmarks/results/speed.md`` (and ``speed-xeon-amx.md``); the table
with its figures is ``docs/measured.md`` (section *Speed profiles*): the figures live there, not here.
The maps' exact products dominate ``default`` and ``balanced`` where there is no AMX.

``lanes32`` (format 1.2) decodes 32 lanes in lock-step with SIMD gathers; its 12-bit tables and
per-lane states cost the ~0.05 bit. Without linear maps (the cross-layer and K->V predictors, 612
exact multiply-adds per value on Gemma 3 270M) a value is predicted from its neighbours only.

>>> p = profile("fast")
>>> p.coder, p.apply(CodecConfig()).inter_map
('lanes32', False)
>>> profile("default").apply(CodecConfig(sink_tokens=4)) == CodecConfig(sink_tokens=4)
True
>>> profile("tiny")
Traceback (most recent call last):
...
alignpred.errors.KvzError: unknown profile 'tiny' (have default, balanced, fast)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from alignpred.codec.config import CodecConfig
from alignpred.errors import KvzError


@dataclass(frozen=True)
class Profile:
    """``coder``: the entropy coder; ``inter_map``: whether the linear-map predictor may be used
    (False switches it off; True leaves the config's choice)."""

    name: str
    coder: str
    inter_map: bool
    summary: str

    def apply(self, config: CodecConfig) -> CodecConfig:
        """``config`` with this profile's predictor choice."""
        return config if self.inter_map else replace(config, inter_map=False)


PROFILES = {p.name: p for p in (
    Profile("default", "rans4", True, "the fewest bits"),
    Profile("balanced", "lanes32", True, "SIMD entropy decoder (format 1.2): ~+0.05 bit/value, faster decode"),
    Profile("fast", "lanes32", False, "SIMD entropy decoder, no linear maps: ~+0.8 bit/value, fastest decode"),
)}


def profile(name: str) -> Profile:
    """The profile called ``name`` (one of :data:`PROFILES`), or :class:`KvzError`."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise KvzError(f"unknown profile {name!r} (have {', '.join(PROFILES)})") from None
