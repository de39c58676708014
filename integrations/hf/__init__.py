"""The transformers adapter (the ``model`` extra): capture a model's KV with exact RoPE metadata
(:mod:`~kvz.integrations.hf.capture`, :mod:`~kvz.integrations.hf.gemma`), RoPE from the model
(:mod:`~kvz.integrations.hf.rope`), and the cache bridge (:mod:`~kvz.integrations.hf.bridge`). Import the
sub-modules; this package imports nothing heavy."""
