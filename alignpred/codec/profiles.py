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

A profile is also where the other choices of *how* a file is written live, those that are neither
the error budget (:class:`~alignpred.ErrorBudget`) nor a bitstream switch of the config: a coder of
its own (``Profile(coder="constriction")``, the reference coder), ``embed_bank`` (the bank travels
inside the file) and ``trust_rope`` (the cache's RoPE metadata is taken as right, unchecked). A
named profile with changes is ``profile("fast", embed_bank=True)``.

>>> p = profile("fast")
>>> p.coder, p.apply(CodecConfig()).inter_map
('lanes32', False)
>>> profile("default").apply(CodecConfig(sink_tokens=4)) == CodecConfig(sink_tokens=4)
True
>>> profile("fast", trust_rope=True).trust_rope, Profile(coder="constriction").inter_map
(True, True)
>>> profile("tiny")
Traceback (most recent call last):
...
alignpred.errors.KvzError: unknown profile 'tiny' (have default, balanced, fast)
>>> profile("fast", codec="rans4")
Traceback (most recent call last):
...
alignpred.errors.KvzError: a profile has no field 'codec' (it has coder, inter_map, embed_bank, trust_rope)
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from alignpred.codec.config import CodecConfig
from alignpred.errors import KvzError


@dataclass(frozen=True)
class Profile:
    """How a file is written, beyond its error budget and its config: ``coder``: the entropy
    coder (:data:`alignpred.entropy.CODERS`); ``inter_map``: whether the linear-map predictor may
    be used (False switches it off; True leaves the config's choice); ``embed_bank``: store the
    bank in the file (counted in bpv; a reader then needs none); ``trust_rope``: skip the check of
    the metadata's RoPE against the keys (:func:`alignpred.cache.check_rope_theta`: a base that
    leaves keys rotated warns, one that makes the frame worse than none is an error) — for keys
    whose RoPE is known, an engine's own. ``name`` and ``summary`` are for listings."""

    name: str = "custom"
    coder: str = "rans4"
    inter_map: bool = True
    summary: str = ""
    embed_bank: bool = False
    trust_rope: bool = False

    def __post_init__(self):
        from alignpred.entropy import CODERS

        if self.coder not in CODERS:
            raise KvzError(f"unknown entropy coder {self.coder!r} (have {', '.join(CODERS)})")
        for f in ("inter_map", "embed_bank", "trust_rope"):
            if not isinstance(getattr(self, f), bool):
                raise KvzError(f"a profile's {f} must be True or False, got {getattr(self, f)!r}")

    def apply(self, config: CodecConfig) -> CodecConfig:
        """``config`` with this profile's predictor choice."""
        return config if self.inter_map else replace(config, inter_map=False)


PROFILES = {p.name: p for p in (
    Profile("default", "rans4", True, "the fewest bits"),
    Profile("balanced", "lanes32", True, "SIMD entropy decoder (format 1.2): ~+0.05 bit/value, faster decode"),
    Profile("fast", "lanes32", False, "SIMD entropy decoder, no linear maps: ~+0.8 bit/value, fastest decode"),
)}


def profile(name, **changes) -> Profile:
    """The profile called ``name`` (one of :data:`PROFILES`; or a :class:`Profile`, as given)
    with ``changes`` (its fields: ``coder``, ``inter_map``, ``embed_bank``, ``trust_rope``), or
    :class:`KvzError`."""
    if isinstance(name, Profile):
        p = name
    else:
        try:
            p = PROFILES[name]
        except (KeyError, TypeError):
            raise KvzError(f"unknown profile {name!r} (have {', '.join(PROFILES)})") from None
    own = [f.name for f in fields(Profile) if f.name not in ("name", "summary")]
    bad = [k for k in changes if k not in own]
    if bad:
        raise KvzError(f"a profile has no field {bad[0]!r} (it has {', '.join(own)})")
    return replace(p, **changes) if changes else p
