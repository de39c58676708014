"""The vLLM reuse benchmark's own logic (no engine: runs in the main venv)."""
import json
import os
import subprocess
import sys


def test_default_model_resolves_after_the_convert_submodule_is_imported(tmp_path):
    """``--quick`` without ``--model`` converted the bundled model through ``from kvz.integrations.vllm
    import convert``, which is the *submodule* once anything imported it: ``TypeError: 'module' object
    is not callable``. An already-converted directory (its marker present) is used as it is."""
    model = tmp_path / ".cache" / "kvz" / "gemma3-hf"
    model.mkdir(parents=True)
    (model / "KVZ_SOURCE.json").write_text(json.dumps({"source": "test"}))
    code = ("import kvz.integrations.vllm.convert\n"
            "from kvz.benchmarks.vllm_reuse import resolve_model\n"
            "print(resolve_model(None))\n")
    env = dict(os.environ, HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(model.resolve())


def test_given_model_is_kept():
    from kvz.benchmarks.vllm_reuse import resolve_model

    assert resolve_model("/some/dir") == "/some/dir"


def test_transcoded_store_is_what_a_writer_in_that_profile_stores(tmp_path, sample_files):
    """``vllm_hit.transcode``: the lossy stores of the hit benchmark are made from the lossless one
    under the same keys; a lookup finds every block, and the decoded KV is within eps of the exact."""
    import numpy as np

    from alignpred import KvzReader, load_cache
    from kvz.benchmarks.vllm_hit import transcode
    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.vllm.store import BlockStore

    c = load_cache(sample_files[0])
    ids = [int(x) for x in json.loads(c.metadata["token_ids"])][:256]
    kv = [tuple(np.asarray(c.tensors[f"layers.{i}.{n}"])[..., :256, :].reshape(1, 256, 256) for n in ("key", "value"))
          for i in range(18)]
    kw = dict(model_id="m", block_size=128, layer_types=json.loads(c.metadata["layer_types"]),
              rope_theta=json.loads(c.metadata["rope_theta"]), shape=(18, 1, 256), dtype="bfloat16",
              bank="gemma-3-270m", threads=1, weights="w-test")
    src = BlockStore(DirectoryBackend(str(tmp_path / "ll")), lossless=True, **kw)
    src.put_run(ids, 0, kv, src.block_hashes(ids, 2))
    # the benchmark's default: the connector's default budget, found by a reader with no setting
    got = transcode(str(tmp_path / "ll"), str(tmp_path / "auto"), src.runs, ids, "fast", weights="w-test")
    assert got["profile"] == "fast" and got["bytes"] > 0
    assert BlockStore(DirectoryBackend(str(tmp_path / "auto")), **kw).lookup(ids, 2)[0] == 2
    # the engine's keys bind the served checkpoint's fingerprint: a store made without it is a miss
    assert BlockStore(DirectoryBackend(str(tmp_path / "auto")), **{**kw, "weights": None}).lookup(ids, 2)[0] == 0
    got = transcode(str(tmp_path / "ll"), str(tmp_path / "fast"), src.runs, ids, "fast", eps=0.02, weights="w-test")
    dst = BlockStore(DirectoryBackend(str(tmp_path / "fast")), eps=0.02, **kw)
    n, segs = dst.lookup(ids, 2)
    assert n == 2
    blob = dst.backend.get(segs[0].run_key)
    r = KvzReader(blob, bank="gemma-3-270m")
    assert r.config.inter_map is False  # the fast profile: no linear maps
    k0 = r.read()["layers.3.key"].astype(np.float64)
    ref = kv[3][0].astype(np.float64)
    assert np.sqrt(((k0 - ref) ** 2).sum() / (ref ** 2).sum()) <= 0.0201


def test_vllm_benchmarks_share_one_module_not_each_other():
    """Issue 41: vllm_reuse and vllm_ttft no longer import each other; what both need is in
    kvz.benchmarks.harness.vllm_engines (vllm_reuse keeps its names for vllm_hit and old callers)."""
    import ast
    import inspect

    from kvz.benchmarks import vllm_reuse, vllm_ttft
    from kvz.benchmarks.harness import vllm_engines

    def imported(mod):
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.ImportFrom):
                names.add(("." * node.level) + (node.module or ""))
                names.update(("." * node.level) + a.name for a in node.names if not node.module)
        return names

    assert not any("vllm_reuse" in n for n in imported(vllm_ttft)), imported(vllm_ttft)
    assert not any("vllm_reuse" in n or "vllm_ttft" in n for n in imported(vllm_engines))
    assert vllm_reuse.build_prompts is vllm_engines.build_prompts and vllm_reuse.BS == vllm_engines.BS
    assert "kvz-cluster" in vllm_reuse.STORES


def test_store_configs_and_the_cluster_rows(tmp_path):
    """Directory stores as before; ``*-cluster`` stores on the run's cluster, one namespace per store
    and run folder; the cluster is started only when a cluster store is asked for."""
    import pytest

    from kvz.benchmarks.harness.vllm_engines import redis_cluster, store_cfg
    from kvz.integrations.kvstore import open_url
    from kvz.integrations.kvstore.server import require_redis

    assert store_cfg("recompute", tmp_path) is None
    assert store_cfg("example", tmp_path) == {"kind": "example", "path": str(tmp_path / "example")}
    assert store_cfg("kvz-lossless", tmp_path) == {"store": str(tmp_path / "kvz-lossless"), "lossless": True,
                                                   "eps": 0.02, "threads": 1}
    with pytest.raises(ValueError, match="cluster"):
        store_cfg("kvz-cluster", tmp_path)
    with redis_cluster(["recompute", "kvz"]) as url:
        assert url is None
    require_redis()
    with redis_cluster(["recompute", "kvz-cluster"]) as url:
        a = store_cfg("kvz-cluster", tmp_path, url)
        b = store_cfg("kvz-lossless-cluster", tmp_path, url)
        assert a["store"] == b["store"] == url and url.startswith("redis+cluster://")
        assert (a["lossless"], b["lossless"]) == (False, True) and a["namespace"] != b["namespace"]
        s = open_url(url, namespace=a["namespace"])
        assert s.put("k", b"v") and s.get("k") == b"v"  # a live cluster
        s.close()


def test_auto_choice_gives_the_engines_every_core_back(tmp_path, monkeypatch):
    """vllm_hit measures auto's choice pinned to the load cores; the engines it starts afterwards
    inherit its affinity, so it must be restored (it was not: every later engine ran on the load
    cores only, its Python thread beside kvz's load thread)."""
    import kvz.benchmarks.vllm_hit as vh
    import kvz.integrations.vllm as kv

    before = os.sched_getaffinity(0)
    seen = []
    monkeypatch.setattr(kv, "choose_profile", lambda *a: seen.append(os.sched_getaffinity(0)) or {"profile": "fast"})
    assert vh.choose_auto(str(tmp_path / "probe"), 256, [min(before)]) == {"profile": "fast"}
    assert seen == [{min(before)}] and os.sched_getaffinity(0) == before
