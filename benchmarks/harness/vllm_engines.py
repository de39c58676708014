"""What the vLLM benchmarks share (:mod:`kvz.benchmarks.vllm_reuse`, :mod:`kvz.benchmarks.vllm_ttft`,
:mod:`kvz.benchmarks.vllm_hit`): the prompts, the model, the stores and one engine process.

Every engine runs in its own process (:mod:`kvz.integrations.vllm.harness`, vLLM's own ``LLM``);
the stores are ``recompute`` (no connector), ``example`` (vLLM's ``ExampleConnector``), ``kvz``
(lossy, eps 0.02) and ``kvz-lossless`` in a directory each, and ``kvz-cluster`` /
``kvz-lossless-cluster``: the same on a Redis Cluster of 3 masters with a replica each
(:func:`redis_cluster`, started from ``redis-server`` on loopback), so the writer and the reader are
two engines on one cluster. Importing this module loads neither numpy nor vLLM.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

BS = 128
QUESTION = 48
SIZES = (1024, 2048, 4096, 8192)
LOGPROBS = 20
SYSTEM = ("You are a careful assistant. Answer questions about the documents below; quote them where you can, "
          "say when they do not contain the answer, and keep answers short.")
CLUSTER_SUFFIX = "-cluster"


def texts() -> list[str]:
    """The calibration texts bundled with the Gemma 3 sample (the documents of the prompts)."""
    d = Path(__file__).resolve().parents[2] / "samples" / "gemma3-270m" / "calib_texts"
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(d.glob("*.txt"))] if d.is_dir() else []


def build_prompts(model_dir: str, sizes, seed: int = 0):
    """``{size: (writer_ids, reader_ids, shared)}``: BOS + system prompt (tagged with the size so no
    two sizes share a block) + documents up to ``size - QUESTION`` tokens, then a question of
    ``QUESTION`` tokens (different for writer and reader)."""
    rng = random.Random(seed)
    docs: list[int] = []
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        for t in texts():
            docs += tok.encode("\n\nDocument:\n" + t, add_special_tokens=False)
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    except Exception:  # noqa: BLE001 - no tokenizer/texts: synthetic ids
        enc = None
    if len(docs) < 1000:
        docs = [rng.randrange(1000, 30000) for _ in range(max(SIZES))]
    out = {}
    for n in sizes:
        head = [2] + (enc(f"[session {n}] " + SYSTEM) if enc else [rng.randrange(1000, 30000) for _ in range(40)])
        body_n = n - QUESTION - len(head)
        body = (docs * (body_n // len(docs) + 1))[:body_n]
        shared = head + body
        # the questions: real text too (a passage from elsewhere in the documents), so greedy decoding
        # is not decided by near-ties
        o = (body_n + 7919 * (n // BS)) % max(1, len(docs) - 2 * QUESTION)
        qw, qr = docs[o:o + QUESTION], docs[o + QUESTION:o + 2 * QUESTION]
        out[n] = (shared + qw, shared + qr, len(shared))
    return out


def resolve_model(model: str | None) -> str:
    """``model``, or (None) the bundled Gemma 3 270M converted once into ``~/.cache/kvz/gemma3-hf``."""
    if model:
        return str(model)
    from kvz.integrations.vllm import convert_model

    return str(convert_model(Path("~/.cache/kvz/gemma3-hf").expanduser()))


def on_cluster(store: str) -> bool:
    return store.endswith(CLUSTER_SUFFIX)


def store_cfg(store: str, root: Path, cluster_url: str | None = None):
    """The connector config of ``store`` (None: no connector). A ``*-cluster`` store keeps its entries
    on the cluster at ``cluster_url``, in a namespace named after ``root`` and the store."""
    if store == "recompute":
        return None
    if store == "example":
        return {"kind": "example", "path": str(root / "example")}
    base = store[:-len(CLUSTER_SUFFIX)] if on_cluster(store) else store
    cfg = {"store": str(root / store), "lossless": base == "kvz-lossless", "eps": 0.02, "threads": 1}
    if on_cluster(store):
        if not cluster_url:
            raise ValueError(f"store {store!r} needs a cluster URL (redis_cluster(stores))")
        import hashlib

        ns = "bench-" + hashlib.sha256(f"{root.resolve()}/{store}".encode()).hexdigest()[:10]
        cfg.update(store=cluster_url, namespace=ns)
    return cfg


@contextlib.contextmanager
def redis_cluster(stores):
    """The URL of a throw-away Redis Cluster (3 masters, a replica each) while any of ``stores`` is a
    ``*-cluster`` store; None (and nothing started) otherwise."""
    if not any(on_cluster(s) for s in stores):
        yield None
        return
    from kvz.integrations.kvstore import RedisClusterServer

    with RedisClusterServer(masters=3, replicas=1) as cl:
        yield cl.url


def engine(spec: dict, root: Path, name: str, timeout: int = 3600, core: int | None = None,
           resume: bool = False) -> dict:
    """Run one engine process on ``spec`` (its output JSON); ``resume``: reuse the output of a run
    with the same spec already in ``root`` (not for a ``*-cluster`` store: its cluster lives for one
    run, so its writer runs again and its reader reads what that writer stored)."""
    sp = root / f"{name}.spec.json"
    out = root / f"{name}.out.json"
    store = spec.get("store")
    if isinstance(store, dict) and str(store.get("store", "")).startswith(("redis+cluster:", "rediss+cluster:")):
        resume = False
    if resume and out.exists() and sp.exists() and json.loads(sp.read_text()) == spec:
        return json.loads(out.read_text())
    sp.write_text(json.dumps(spec))
    env = dict(os.environ)
    if core is not None:  # one thread per engine (the same thread count for every store), spread over the cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with open(root / f"{name}.log", "w") as log:
        rc = subprocess.call([sys.executable, "-m", "kvz.integrations.vllm.harness", str(sp), str(out)],
                             env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(root), timeout=timeout)
    if rc != 0 or not out.exists():
        tail = (root / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"engine {name} failed (rc {rc}):\n{tail}")
    return json.loads(out.read_text())
