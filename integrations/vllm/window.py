"""Sliding-window layers on a hit: decode only the positions the rest of the prompt can read.

A sliding-window layer (Gemma 2/3, Mistral, gpt-oss; 15 of Gemma 3 270M's 18 layers, window 512)
attends to the last ``W`` positions only. On a hit of ``P`` tokens, the prompt's next positions are
``>= P``, so such a layer never reads its keys and values before ``P - W`` again: a load decodes
(and reads from the store) only from ``P - W - block_size`` there (one block of margin), and
writes zeros before it. On an 8K hit of Gemma 3 270M that is 3 x 8,064 + 15 x ~770 positions to
decode instead of 18 x 8,064: about 4x less decode and read.

This holds only while nothing else reads those blocks: with vLLM's prefix caching on, a later
request of a shorter shared prefix would take them from the engine's own cache and read the zeros.
So the connector windows its loads only where the engine's prefix caching is off
(``window_loads: "auto"``, the default; ``"off"`` never, ``"on"`` always — for an engine that
never shares blocks). The blocks stored are never windowed: the saver writes the positions the
engine computed, and a load never stores what it loaded.

Only files whose layers are predicted without other layers' reconstructions (the ``fast``
profile: no linear maps) skip work: with maps, a decode from ``P - W`` of one layer would still
need its sources there, so :func:`windowed_layers` decodes such files whole (the same result, as
the skipped positions are then written, not zeroed).

>>> layer_windows(["sliding_attention", "full_attention"], 512)
[512, None]
>>> segment_starts([512, None], first_block=0, count=64, hit_blocks=64, block_size=128)
{0: 7552}
>>> segment_starts([512, None], first_block=0, count=8, hit_blocks=64, block_size=128)
{0: 1024}
"""
from __future__ import annotations

from collections.abc import Iterator

__all__ = ["layer_windows", "window_setting", "segment_starts", "load_starts", "windowed_layers", "skips_work"]


def layer_windows(layer_types, sliding_window) -> list[int | None]:
    """Per layer: its window in positions (a ``sliding_attention`` layer), or None (full attention)."""
    w = int(sliding_window) if sliding_window else 0
    return [w if w > 0 and str(t) == "sliding_attention" else None for t in layer_types]


def window_setting(layer_types, sliding_window, prefix_caching: bool, setting: str = "auto") -> tuple[list, str]:
    """The connector's ``window_loads`` setting (``auto``, ``on`` or ``off``) as per-layer windows
    (:func:`layer_windows`, all None where loads are not windowed) and the reason, logged.

    >>> window_setting(["sliding_attention", "full_attention"], 512, prefix_caching=True)[0]
    [None, None]
    >>> window_setting(["sliding_attention", "full_attention"], 512, prefix_caching=False)
    ([512, None], '1 of 2 layers decoded from their window (window_loads auto)')
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"kvz connector: window_loads must be auto, on or off, not {setting!r}")
    windows = layer_windows(layer_types, sliding_window)
    n = sum(w is not None for w in windows)
    if not n:
        return windows, "no sliding-window layers"
    if setting == "off":
        return [None] * len(windows), "window_loads off"
    if setting == "auto" and prefix_caching:
        return [None] * len(windows), ("prefix caching is on: a shorter prefix taken from the engine's cache "
                                       "would read a window's zeros")
    return windows, f"{n} of {len(windows)} layers decoded from their window (window_loads {setting})"


def segment_starts(windows, *, first_block: int, count: int, hit_blocks: int, block_size: int) -> dict[int, int]:
    """``{layer: first position to decode}`` within a segment of ``count`` blocks from the
    request's block ``first_block``, on a hit of ``hit_blocks`` blocks; layers absent start at 0,
    a start equal to the segment's length means the layer has nothing to decode there."""
    n = count * block_size
    need_from = hit_blocks * block_size - block_size  # the first new position, one block of margin
    out = {}
    for layer, w in enumerate(windows):
        if w is None:
            continue
        s = min(n, max(0, need_from - int(w) - first_block * block_size))
        s -= s % block_size
        if s > 0:
            out[layer] = s
    return out


def load_starts(windows, loads, block_size: int) -> dict:
    """:func:`segment_starts` of every segment of a step's loads (``LoadSpec``s), by
    ``(request id, segment's first block)``."""
    out = {}
    for spec in loads:
        end = spec.segments[-1].first + spec.segments[-1].count if spec.segments else 0
        for seg in spec.segments:
            out[(spec.req_id, seg.first)] = segment_starts(windows, first_block=seg.first, count=seg.count,
                                                           hit_blocks=end, block_size=block_size)
    return out


def skips_work(reader) -> bool:
    """Whether a windowed decode of ``reader`` does less work: no layer is predicted from another's
    reconstruction (no plan has sources)."""
    return not any(p.sources for p in reader.decoder.plans.values())


def _zeros(out, layer: int, start: int):
    k, v = out(layer)
    for t in (k, v):
        t[:, :start] = 0
    return k, v


def windowed_layers(reader, tokens, starts: dict, out) -> Iterator[tuple]:
    """``reader.layers(tokens, out=out)``, except that layer ``i`` is decoded only from position
    ``starts[i]`` of the range (relative to ``tokens[0]``) and zeros are written before it; ``out``:
    ``layer -> (key, value)`` buffers ``[kv_heads, n, d]`` (numpy or torch), the same each call.
    Yields ``(layer, key, value)`` in layer order, the full buffers.

    Tested against whole reads, in-process and in kvz's decode process, in
    ``tests/integrations/test_vllm_window.py``; in vLLM's engine in ``tests/integrations/vllm_engine/test_window.py``.
    """
    a, b = int(tokens[0]), int(tokens[1])
    n = b - a
    starts = {int(i): int(s) for i, s in (starts or {}).items() if int(s) > 0}
    if not starts or not skips_work(reader):
        for i, _, _ in reader.layers(tokens=(a, b), out=out):
            k, v = out(i)
            yield i, k, v
        return
    L = reader.layout.num_layers
    i = 0
    while i < L:
        s = min(starts.get(i, 0), n)
        j = i
        while j + 1 < L and min(starts.get(j + 1, 0), n) == s:
            j += 1
        group = list(range(i, j + 1))
        if s < n:
            part = reader.layers(tokens=(a + s, b), layers=group,
                                 out=lambda li, s=s: tuple(t[:, s:] for t in out(li)))
            for li, _, _ in part:
                yield (li, *_zeros(out, li, s))
        else:
            for li in group:
                yield (li, *_zeros(out, li, s))
        i = j + 1

