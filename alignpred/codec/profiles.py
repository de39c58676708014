"""Speed profiles: named trade-offs between file size and decode speed.

A profile is a choice of entropy coder and predictors, applied on top of a
:class:`~alignpred.codec.config.CodecConfig`; every one meets the same error budget (the step
search does not change), so they differ only in bits and decode time. The file records the coder
and the config as always, so a reader needs nothing else: a profile never appears in a header.

==========  =================  ============  =============  ==========================================
profile     entropy coder      linear maps   bits/value     one-core decode, M values/s (x SZ3)
==========  =================  ============  =============  ==========================================
default     ``rans4``          yes           3.837          75.9 (0.45x) Zen 4; 108.5 (0.84x) Xeon+AMX
balanced    ``lanes32`` (1.2)  yes           3.886 (+0.05)  95.1 (0.57x) Zen 4; 159.7 (1.24x) Xeon+AMX
fast        ``lanes32`` (1.2)  no            4.623 (+0.79)  338.5 (2.02x) Zen 4; 357.5 (2.78x) Xeon+AMX
==========  =================  ============  =============  ==========================================

Measured by ``python -m kvz.benchmarks.speed`` (``benchmarks/results/speed.md``, an AMD EPYC with
AVX-512 VNNI and no AMX; ``speed-xeon-amx.md``, an Intel Xeon whose AMX tiles
run the map products): Gemma 3 270M, 8 held-out 2,048-token caches, eps 0.0267, tensor scope.
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
