"""transformers ``DynamicCache`` subclasses kvz needs (built on first use: transformers is imported lazily).

* :func:`recording_cache_cls` — a cache that also keeps every K/V chunk handed to ``update`` (all
  positions of every layer, sliding-window layers included): how kvz captures a model's full KV
  (:func:`kvz.integrations.hf.bridge.capture_prefill`, :func:`kvz.integrations.hf.capture.record_kv`);
* :func:`ScatterCache` — writes the K/V of scattered positions being computed into full per-layer
  buffers in place and hands attention every position (the chunk store's repair forward);
* :func:`BufferedCache` — an ordinary cache that also writes the K/V of a computed suffix into
  those buffers (the chunk store's prefill of a suffix).

The classes are made once per process (:func:`functools.cache`), so ``isinstance`` checks hold
across calls.
"""
from __future__ import annotations

import functools

__all__ = ["recording_cache_cls", "ScatterCache", "BufferedCache"]


@functools.cache
def recording_cache_cls():
    """The recording cache class: ``cls(config=..., store_dtype=None)``; ``recorded[layer] =
    ([keys...], [values...])`` as handed to ``update`` (detached; with ``store_dtype`` copied to the
    CPU in that torch dtype), while ``recording`` is true."""
    import torch
    from transformers import DynamicCache

    class RecordingCache(DynamicCache):
        """A DynamicCache that also keeps every K/V chunk handed to ``update`` (all positions of every
        layer, sliding layers included). ``recorded[layer] = ([keys...], [values...])``."""

        def __init__(self, *args, store_dtype=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorded: dict = {}
            self.recording = True
            self.store_dtype = store_dtype

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.recording:
                ks, vs = self.recorded.setdefault(layer_idx, ([], []))
                if self.store_dtype is None:
                    ks.append(key_states.detach())
                    vs.append(value_states.detach())
                else:
                    with torch.no_grad():
                        ks.append(key_states.detach().to("cpu", self.store_dtype, copy=True))
                        vs.append(value_states.detach().to("cpu", self.store_dtype, copy=True))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        def full_kv(self) -> list:
            """``[(key, value)]`` per layer, ``[kv_heads, T, head_dim]``, every recorded position."""
            out = []
            for i in range(len(self.recorded)):
                ks, vs = self.recorded[i]
                out.append((torch.cat(ks, dim=-2)[0], torch.cat(vs, dim=-2)[0]))
            return out

    return RecordingCache


@functools.cache
def _scatter_cls():
    from transformers import DynamicCache

    class _ScatterCache(DynamicCache):
        """Writes the K/V of the positions being computed into the full per-layer buffers (in place)
        and hands attention every position; the explicit masks say what each query may see."""

        def __init__(self, K, V, positions):
            super().__init__()
            self.K, self.V, self.pos = K, V, positions
            self.T = K[0].shape[-2]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.K[layer_idx][:, :, self.pos] = key_states.to(self.K[layer_idx].dtype)
            self.V[layer_idx][:, :, self.pos] = value_states.to(self.V[layer_idx].dtype)
            return self.K[layer_idx], self.V[layer_idx]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.T

    return _ScatterCache


@functools.cache
def _buffered_cls():
    from transformers import DynamicCache

    class _BufferedCache(DynamicCache):
        """A normal DynamicCache that also writes the K/V of computed positions into the buffers."""

        def __init__(self, K, V, start, **kw):
            super().__init__(**kw)
            self.K, self.V, self.start = K, V, start
            self.recording = False

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.recording:
                n = key_states.shape[-2]
                self.K[layer_idx][:, :, self.start:self.start + n] = key_states
                self.V[layer_idx][:, :, self.start:self.start + n] = value_states
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _BufferedCache


def ScatterCache(K, V, positions):  # noqa: N802 - a factory that reads like the class
    """A cache over per-layer buffers ``K[i]``, ``V[i]`` (torch ``[1, H, T, d]``) that writes the
    K/V of ``positions`` (a long tensor of absolute positions, sorted) into them in place and
    returns the whole buffers to attention (``get_seq_length`` is ``T``)."""
    return _scatter_cls()(K, V, positions)


def BufferedCache(K, V, start: int, **kw):  # noqa: N802 - a factory that reads like the class
    """A ``DynamicCache(**kw)`` that, while ``recording`` is true, also writes the K/V handed to
    ``update`` into ``K[i]``, ``V[i]`` from position ``start`` on."""
    return _buffered_cls()(K, V, start, **kw)
