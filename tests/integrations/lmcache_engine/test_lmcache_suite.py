# ruff: noqa: F811  (pytest fixtures imported from the test library are parameters of the tests)
"""LMCache's own storage-backend tests, run against kvz's storage plugin and remote connector.

LMCache 0.5.6's test suite is not in its wheel; ``.ci/lmcache.sh`` downloads the sdist (sha256
pinned), unpacks its ``tests/`` and points ``KVZ_LMCACHE_TESTS`` at it. The test *functions* below
are LMCache's, imported unchanged from its modules; only the fixtures they ask for are kvz's:
pytest resolves a fixture where the test is collected, so ``local_disk_backend`` (LMCache's
``LocalDiskBackend`` in its own module) is kvz's storage plugin here, built by LMCache's
``StorageManager`` from LMCache config keys, and ``remote_backend_with_fs`` (LMCache's ``FSConnector``)
is LMCache's ``RemoteBackend`` over kvz's remote connector. Test bodies, keys and assertions are
LMCache's.

Where it applies — and where not, and why:

- ``test_local_disk_backend.py``: ``TestLocalDiskBackend.test_contains_key_not_exists``,
  ``test_get_blocking_key_not_exists``; ``TestBatchedGetBlocking.test_all_keys_missing``,
  ``test_empty_keys_list``. Not: ``test_init``/``test_str``/``test_key_to_path``/``TestMultiPathDiskBackend``
  /``TestParseLocalDisk``/``TestSubmitPutTask``/``TestGetBlockingCachePolicyUpdate`` and the hit cases of
  ``TestBatchedGetBlocking`` (they test ``LocalDiskBackend``'s own fields: ``.dict``, ``.usage``,
  ``.cache_policy``, ``_key_to_path``, its ``.pt`` files written by hand with ``os.urandom`` bytes).
- ``test_fs_connector.py``: ``TestFSConnector.test_contains_key_not_exists``,
  ``test_get_blocking_key_not_exists``. Not: ``test_put_and_get_roundtrip``/``test_batched_put_and_get``
  (they store ``create_test_memory_obj()``: an *uninitialised* ``[2, 16, 8, 128]`` buffer, whatever
  bytes the allocator held — a KV codec refuses NaN/Inf and has no bank for that shape; kvz's own
  tests round-trip real Gemma 3 KV through the same RemoteBackend), and the ``fs://`` URL/path tests.
- ``tests/v1/utils.py``'s interface checks (``get_abstract_methods``, ``get_methods_implemented_in_class``,
  ``check_method_signatures``, what ``test_impl_completeness.py`` runs on LMCache's wrapper classes):
  every abstract method of LMCache's base class implemented, every signature LMCache's. Not its
  "every base method overridden" step: that is for wrappers that must forward each call; a plugin
  keeps the base class's batched defaults.
- ``test_storage_plugin.py``/``test_remote_storage_plugin.py`` test the plugin launchers with
  LMCache's mock classes (their call histories), not a plugin's behaviour; kvz's own tests load kvz's
  classes through the same launchers (``test_storage_plugin.py``, ``test_connector.py`` here).
"""
import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()

from lmcache_testlib import kvz_extra, lm_config, lm_metadata  # noqa: E402

SUITE = os.environ.get("KVZ_LMCACHE_TESTS")
if not SUITE or not os.path.isdir(os.path.join(SUITE, "tests", "v1")):
    if os.environ.get("KVZ_REQUIRE_LMCACHE_SUITE"):
        raise RuntimeError(f"KVZ_LMCACHE_TESTS={SUITE!r} does not hold LMCache's tests/v1 (see .ci/lmcache.sh)")
    pytest.skip("LMCache's own test suite is not unpacked (KVZ_LMCACHE_TESTS; .ci/lmcache.sh does it)",
                allow_module_level=True)
if SUITE not in sys.path:
    sys.path.insert(0, SUITE)  # LMCache's modules import their helpers as tests.v1.utils


def _lmcache_test_module(name):
    mod = importlib.import_module(f"tests.v1.{name}")
    if not os.path.abspath(mod.__file__).startswith(os.path.abspath(SUITE)):
        raise RuntimeError(f"tests.v1.{name} resolved to {mod.__file__}, not LMCache's suite under {SUITE}")
    return mod


disk = _lmcache_test_module("storage_backend.test_local_disk_backend")
fs = _lmcache_test_module("storage_backend.test_fs_connector")
checks = _lmcache_test_module("utils")

PLUGIN = {"storage_plugin.kvz.module_path": "kvz.integrations.lmcache",
          "storage_plugin.kvz.class_name": "KvzStoragePlugin"}
CONN = {"remote_storage_plugin.kvzr.module_path": "kvz.integrations.lmcache",
        "remote_storage_plugin.kvzr.class_name": "KvzRemoteConnector"}


def _storage_manager(cfg):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    return StorageManager(config=cfg, metadata=lm_metadata(), event_manager=EventManager())


@pytest.fixture
def local_disk_backend(tmp_path):
    """kvz's storage plugin (compressed local-disk tier) where LMCache's tests ask for its disk backend."""
    extra = dict(PLUGIN, **kvz_extra("storage_plugin.kvz", path=str(tmp_path / "kvz")))
    sm = _storage_manager(lm_config(extra_config=extra, storage_plugins=["kvz"]))
    plugin = sm.storage_backends["kvz"]
    assert type(plugin).__name__ == "KvzStoragePlugin"
    yield plugin
    sm.close()


@pytest.fixture
def remote_backend_with_fs(tmp_path):
    """LMCache's RemoteBackend over kvz's remote connector (a directory store) where LMCache's tests
    ask for its FSConnector."""
    extra = dict(CONN, **kvz_extra("remote_storage_plugin.kvzr", url="file://" + str(tmp_path / "remote")))
    sm = _storage_manager(lm_config(extra_config=extra, remote_storage_plugins=["kvzr"], remote_serde="naive"))
    remote = sm.storage_backends["RemoteBackend-kvzr"]
    assert type(remote.connection).__name__ == "KvzRemoteConnector" or "Kvz" in repr(remote.connection)
    yield remote
    sm.close()


class TestDiskTier:
    """LMCache's LocalDiskBackend tests on kvz's storage plugin."""

    test_contains_key_not_exists = disk.TestLocalDiskBackend.test_contains_key_not_exists
    test_get_blocking_key_not_exists = disk.TestLocalDiskBackend.test_get_blocking_key_not_exists
    test_all_keys_missing = disk.TestBatchedGetBlocking.test_all_keys_missing
    test_empty_keys_list = disk.TestBatchedGetBlocking.test_empty_keys_list


class TestRemoteTier:
    """LMCache's FSConnector-through-RemoteBackend tests on kvz's remote connector."""

    test_contains_key_not_exists = fs.TestFSConnector.test_contains_key_not_exists
    test_get_blocking_key_not_exists = fs.TestFSConnector.test_get_blocking_key_not_exists


def _kvz_pairs():
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    from kvz.integrations.lmcache import KvzRemoteConnector, KvzStoragePlugin

    return [(RemoteConnector, KvzRemoteConnector), (StoragePluginInterface, KvzStoragePlugin)]


@pytest.mark.parametrize("base_class,impl_class", _kvz_pairs(), ids=["remote-connector", "storage-plugin"])
def test_interface_completeness(base_class, impl_class):
    """LMCache's interface checks: abstract methods implemented, signatures as LMCache declares them."""
    implemented = checks.get_methods_implemented_in_class(impl_class, base_class)
    missing = sorted(checks.get_abstract_methods(base_class) - implemented)
    assert not missing, f"{impl_class.__name__} does not implement {missing}"
    mismatches = checks.check_method_signatures(base_class, impl_class)
    assert not mismatches, f"{impl_class.__name__}: {mismatches}"
