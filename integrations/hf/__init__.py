"""The transformers adapter (the ``model`` extra) — the one place kvz touches transformers.

* :mod:`~kvz.integrations.hf.capture` — capture any decoder's full KV with its exact RoPE
  (:func:`capture_model`, :func:`record_kv`), load a model directory or GGUF (:func:`load_model`);
* :mod:`~kvz.integrations.hf.gemma` — the same for the bundled Gemma 3 270M (:func:`load_gemma`,
  :func:`capture_gemma`);
* :mod:`~kvz.integrations.hf.rope` — the RoPE a model applies, as a kvz ``RopeSpec``
  (:func:`rope_spec_from_model`);
* :mod:`~kvz.integrations.hf.bridge` — a model's KV to ``.kvz`` and back into a cache ``generate``
  continues from (:func:`capture_prefill`, :func:`save_kv`, :func:`load_kvz_cache`, :func:`build_cache`);
* :mod:`~kvz.integrations.hf.caches` — the ``DynamicCache`` subclasses (recording, scatter, buffered).

Other packages import these names from here (``from kvz.integrations.hf import kv_shape``).
Names are imported lazily (PEP 562): importing this package loads neither torch nor transformers.
``text_config`` here takes a *model* (:func:`kvz.integrations.hf.bridge.text_config`).
"""
from __future__ import annotations

from kvz.integrations import lazy_exports

_MODULES = {
    "bridge": ("RecordingCache", "capture_prefill", "save_kv", "load_kvz_cache", "cache_from_kv", "new_cache",
               "kv_metadata", "model_id_of", "kv_shape", "cache_kwarg", "text_config", "build_cache",
               "forward_logits", "last_kv"),
    "caches": ("recording_cache_cls", "ScatterCache", "BufferedCache"),
    "capture": ("FORMAT_NAME", "FORMAT_VERSION", "DTYPES", "INSTALL_HINT", "require_modules", "load_gguf",
                "load_model", "tokenize", "capture_model", "record_kv", "cache_metadata", "save_model_dir",
                "write_cache_atomic", "safetensors_chunks"),
    "gemma": ("MODEL_ID", "model_dir", "load_gemma", "layer_info"),
    "rope": ("UnsupportedRope", "rope_spec_from_model", "rope_spec_from_config", "prefill_chunk",
             "record_rope_calls", "decoder_of", "layer_types_of", "rope_thetas", "takes_layer_type"),
}
_EXPORTS = {name: (f"kvz.integrations.hf.{mod}", name) for mod, names in _MODULES.items() for name in names}
_EXPORTS["capture_gemma"] = ("kvz.integrations.hf.gemma", "capture")

__all__ = list(_EXPORTS)


_lazy = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str):
    if name == "load_cache":  # the old name of load_kvz_cache (alignpred.load_cache is another function)
        import warnings

        warnings.warn("kvz.integrations.hf.load_cache is deprecated: use load_kvz_cache (.kvz -> transformers "
                      "cache); alignpred.load_cache reads a safetensors capture", DeprecationWarning, stacklevel=2)
        return _lazy("load_kvz_cache")
    return _lazy(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
