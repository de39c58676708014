"""kvz as vLLM's KV store (``kv_connector_module_path="kvz.integrations.vllm"``, connector
``KvzConnector``): see :mod:`kvz.integrations.vllm.connector`.

Importing this package does not import vLLM; ``KvzConnector`` is loaded on first use.
"""
from __future__ import annotations

__all__ = ["KvzConnector", "KvzConnectorMetadata", "BlockStore", "KvzVllmWarning", "DEFAULT_STORE", "convert_model",
           "mean_kl", "choose_profile"]


def __getattr__(name):
    if name in ("KvzConnector", "KvzConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    if name == "choose_profile":
        from .profile_choice import choose_profile

        return choose_profile
    if name == "mean_kl":
        from .harness import mean_kl

        return mean_kl
    if name == "convert_model":  # not ``convert``: that name is the submodule once anything imported it
        from .convert import convert

        return convert
    if name in ("BlockStore", "KvzVllmWarning", "DEFAULT_STORE"):
        from . import store

        return getattr(store, name)
    raise AttributeError(name)
