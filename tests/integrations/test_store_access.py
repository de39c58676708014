"""Issue 38, acceptance point 4, on one Redis node and on a 3-master Redis Cluster: a wrong password
(in the URL or in ``KVZ_REDIS_PASSWORD``), no password, an ACL user without the store's keys or
without its commands, and an unreachable store are

* in the engines' store layers — the vLLM connector's :class:`~kvz.integrations.vllm.store.BlockStore`
  over ``open_url`` (what the connector builds), its ``auto`` profile's bandwidth probe, and the
  chunk store (:class:`~kvz.integrations.chunkstore.ChunkStore`, under LMCache and SGLang) — misses and
  refused puts with exactly one clear warning, and no call raises;
* in the CLI (``kvz store stats URL``, ``kvz store gc URL``) one ``Error:`` line and exit status 1;

and no password appears in any warning, error line, log record or ``repr``. Every server is real
(``redis-server`` processes on free loopback ports); without redis-server the tests are skipped, with
``KVZ_REQUIRE_REDIS=1`` they fail."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
from test_kvstore_cluster import ACL_RULES, run_cli

from kvz.integrations.kvstore import (
    RedisClusterServer,
    RedisServer,
    StoreAccessWarning,
    StoreUnavailableWarning,
    StoreWarning,
    open_url,
)
from kvz.integrations.kvstore.server import _free_port, require_redis

PW, WRONG, USER_PW, READER_PW = "Rt9f3c-right-secret", "Wr77ab-wrong-secret", "Kv1e5d-user-secret", "Rd4c2a-rdr-secret"
SECRETS = (PW, WRONG, USER_PW, READER_PW)
NS = "allowed"  # the namespace the ACL user "kvz" may use
USERS = {"kvz": ACL_RULES.replace("{kvz*", "{" + NS + "*").replace(">pw", ">" + USER_PW),
         "reader": f"on >{READER_PW} ~* -@all +ping +info"}
# case -> (user, password in the URL, password in KVZ_REDIS_PASSWORD, namespace, warning, words of the reason)
CASES = {
    "wrong password": ("default", WRONG, None, NS, StoreAccessWarning, "authentication failed"),
    "wrong password from the environment": (None, None, WRONG, NS, StoreAccessWarning, "authentication failed"),
    "no password": (None, None, None, NS, StoreAccessWarning, "authentication failed"),
    "ACL without the namespace's keys": ("kvz", USER_PW, None, "denied", StoreAccessWarning, "permission denied"),
    "ACL without the store's commands": ("reader", READER_PW, None, NS, StoreAccessWarning, "permission denied"),
    "unreachable": (None, None, None, NS, StoreUnavailableWarning, "unreachable"),
}


class Secured:
    """One node or a cluster with ``requirepass`` and the ACL users above."""

    def __init__(self, kind: str):
        require_redis()
        self.kind = kind
        if kind == "redis":
            self.server = RedisServer(args=["--requirepass", PW]).start()
            import redis

            c = redis.Redis(self.server.host, self.server.port, password=PW)
            for name, rules in USERS.items():
                c.execute_command("ACL", "SETUSER", name, *rules.split())
            c.close()
        else:
            self.server = RedisClusterServer(replicas=0, password=PW, users=USERS).start()

    def url(self, user=None, password=None, namespace=NS) -> str:
        base = self.server.url
        if password is not None:
            base = base.replace("://", f"://{user}:{password}@", 1)
        return f"{base}?namespace={namespace}"

    def unreachable_url(self) -> str:
        port = _free_port("127.0.0.1")  # nothing listens there
        return (f"redis://127.0.0.1:{port}/0" if self.kind == "redis" else f"redis+cluster://127.0.0.1:{port}/") + \
            f"?namespace={NS}"

    def case_url(self, case: str) -> str:
        user, pw, _, namespace, _, _ = CASES[case]
        return self.unreachable_url() if case == "unreachable" else self.url(user, pw, namespace)


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def secured(request):
    s = Secured(request.param)
    yield s
    s.server.close()


@pytest.fixture
def case_env(request, monkeypatch):
    """The case's KVZ_REDIS_PASSWORD (or none), and every log record of every logger."""
    monkeypatch.delenv("KVZ_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("KVZ_REDIS_USERNAME", raising=False)
    env_pw = CASES[request.param][2]
    if env_pw is not None:
        monkeypatch.setenv("KVZ_REDIS_PASSWORD", env_pw)
    return request.param


def _no_secret(*texts) -> None:
    for t in texts:
        for s in SECRETS:
            assert s not in str(t), (s, str(t)[:300])


def _one_warning(caught, case):
    _, _, _, _, category, words = CASES[case]
    ours = [w for w in caught if issubclass(w.category, StoreWarning) or w.category.__name__ == "KvzVllmWarning"]
    msgs = [f"{w.category.__name__}: {w.message}" for w in ours]
    assert len(ours) == 1, (case, msgs)
    assert issubclass(ours[0].category, category) and words in str(ours[0].message), (case, msgs)
    _no_secret(*msgs)
    return str(ours[0].message)


@pytest.fixture(scope="module")
def one_block(sample_files):
    """One 128-token block of the real Gemma 3 270M sample: ids, per-layer (K, V), layer types, RoPE bases."""
    from alignpred import load_cache

    c = load_cache(sample_files[0])
    ids = [int(x) for x in json.loads(c.metadata["token_ids"])][:128]
    kv = []
    for i in range(18):
        k = np.asarray(c.tensors[f"layers.{i}.key"])[..., :128, :]
        v = np.asarray(c.tensors[f"layers.{i}.value"])[..., :128, :]
        kv.append((k[0] if k.ndim == 4 else k, v[0] if v.ndim == 4 else v))
    return ids + [7], kv, json.loads(c.metadata["layer_types"]), json.loads(c.metadata["rope_theta"])


def test_the_right_credentials_work(secured, monkeypatch):
    """The baseline the failures are measured against: the default user, the ACL user on its own
    namespace, and the password from the environment all store and read, with no warning."""
    monkeypatch.delenv("KVZ_REDIS_PASSWORD", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for url in (secured.url("default", PW), secured.url("kvz", USER_PW)):
            s = open_url(url, reconnect_interval=0)
            assert s.put("k", b"v") and s.get("k") == b"v" and s.check()["entries"] >= 1
            _no_secret(repr(s), s.url, s.stats())
            s.close()
        monkeypatch.setenv("KVZ_REDIS_PASSWORD", PW)
        s = open_url(secured.url(), reconnect_interval=0)
        assert s.get("k") == b"v"
        _no_secret(repr(s), s.url)
        s.close()
    assert not [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]


@pytest.mark.parametrize("case_env", list(CASES), indirect=True)
def test_vllm_block_store_one_warning_and_misses(secured, case_env, one_block, caplog):
    """What the vLLM connector does with its store, in order: the ``auto`` profile's bandwidth probe
    (warm-up), a lookup at scheduling, a save after the prefill, the next request's lookup. All miss
    or refuse, nothing raises, one warning in all, no password in it or in any log record."""
    from kvz.integrations.kvstore import open_url
    from kvz.integrations.vllm import profile_choice as pc
    from kvz.integrations.vllm.store import BlockStore

    case = case_env
    ids, kv, types, thetas = one_block
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = open_url(secured.case_url(case), namespace=CASES[case][3], reconnect_interval=0)
        store = BlockStore(backend, model_id="gemma-3-270m-test", block_size=128, layer_types=types,
                           rope_theta=thetas, shape=(18, 1, 256), dtype="bfloat16", bank="gemma-3-270m", threads=1)
        assert pc.measure_read(backend, nbytes=1 << 16) == 0.0
        assert store.lookup(ids, 1) == (0, [])
        assert store.put_run(ids, 0, kv, store.block_hashes(ids, 1)) == 0
        assert store.lookup(ids, 1) == (0, []) and store.stored_prefix(ids, 1) == 0
        _no_secret(repr(backend), backend.stats())
        backend.close()
    _one_warning(caught, case)
    _no_secret(caplog.text)


@pytest.mark.parametrize("case_env", list(CASES), indirect=True)
def test_chunk_store_one_warning_and_misses(secured, case_env, caplog):
    """The chunk store (LMCache's and SGLang's adapters store through it): puts refused, lookups miss."""
    from alignpred.cache.rope import RopeSpec
    from kvz.integrations.chunkstore import ChunkStore

    case = case_env
    caplog.set_level(logging.DEBUG)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = ChunkStore(open_url(secured.case_url(case), reconnect_interval=0), model_id="synthetic",
                        layer_types=["full_attention"] * 2, rope=RopeSpec.from_thetas([1e4] * 2, head_dim=8),
                        shape=(2, 2, 8), codec="raw", chunk_tokens=8, raw_dtype="float32")
        ids = list(range(100, 124))
        chunks = st.chunks(ids)
        for c in chunks:
            kv = [(rng.standard_normal((2, c.n, 8)).astype(np.float32),
                   rng.standard_normal((2, c.n, 8)).astype(np.float32)) for _ in range(2)]
            assert st.put(c, kv, ids[c.start:c.end], exact=True) == 0
        assert st.lookup(ids, chunks) == []
        st.backend.close()
    _one_warning(caught, case)
    _no_secret(caplog.text)


@pytest.mark.parametrize("case_env", list(CASES), indirect=True)
@pytest.mark.parametrize("command", ["stats", "gc"])
def test_cli_one_error_line_and_exit_1(secured, case_env, command):
    case = case_env
    _, _, _, namespace, _, words = CASES[case]
    r = run_cli("store", command, secured.case_url(case), "--namespace", namespace)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], \
        (case, r.stderr)
    assert r.stdout == ""
    _no_secret(r.stderr, r.stdout)


def test_cli_process_exit_status_and_env_password(secured, tmp_path):
    """The installed command as a process: a wrong password from the environment (never on the
    command line) is one error line on stderr, nothing on stdout, exit status 1; the right one works."""
    import os

    env = dict(os.environ, KVZ_REDIS_PASSWORD=WRONG)
    env.pop("KVZ_REDIS_USERNAME", None)
    cmd = [sys.executable, "-m", "kvz.cli.main", "store", "stats", secured.url()]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and \
        "authentication failed" in lines[0], r.stderr
    assert r.stdout == ""
    _no_secret(r.stderr)
    env["KVZ_REDIS_PASSWORD"] = PW
    r = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["namespace"] == NS
    _no_secret(r.stdout, r.stderr)


def test_vllm_block_store_isolation(tmp_path, one_block):
    """Two models, two banks or two budgets in one store (one directory, one namespace) never read each
    other's runs: the keys bind model id, bank, eps / budget and the .kvz format major."""
    from alignpred.format import MAJOR
    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.vllm.store import BlockStore

    ids, kv, types, thetas = one_block
    be = DirectoryBackend(str(tmp_path / "s"))

    def store(**kw):
        args = dict(model_id="gemma-3-270m-test", block_size=128, layer_types=types, rope_theta=thetas,
                    shape=(18, 1, 256), dtype="bfloat16", bank="gemma-3-270m", threads=1, eps=0.02)
        args.update(kw)
        return BlockStore(be, **args)

    writer = store()
    assert writer.binding["format_major"] == MAJOR
    assert writer.put_run(ids, 0, kv, writer.block_hashes(ids, 1)) > 0
    assert writer.lookup(ids, 1)[0] == 1 and store().lookup(ids, 1)[0] == 1  # the same binding finds it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a store without a bank says it codes without one
        others = [store(model_id="another-model"), store(bank=None), store(eps=0.03), store(lossless=True)]
    for other in others:
        assert other.lookup(ids, 1) == (0, []), other.binding
