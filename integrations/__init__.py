"""Bridges between kvz and real model runtimes (optional ``model`` extra), one folder per runtime or layer.

* :mod:`kvz.integrations.hf` — the transformers adapter (capture, RoPE, cache bridge, cache classes):
  the only package that touches transformers;
* :mod:`kvz.integrations.kvstore` — byte blobs under string keys (directory, Redis) with a byte budget;
* :mod:`kvz.integrations.chunkstore` — KV chunk reuse across prompts on a kvstore backend;
* :mod:`kvz.integrations.pager` — paging full KV in from ``.kvz`` files under a memory budget;
* :mod:`kvz.integrations.verify` — draft on compressed KV, verify on the full KV (lossless decoding);
* the serving engines' connectors (:mod:`kvz.integrations.vllm`, ``lmcache``, ``sglang``).

Packages use each other through package-level names only (``from kvz.integrations.hf import kv_shape``).
"""
