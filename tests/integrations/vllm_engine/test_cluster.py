"""Two vLLM engines, one Redis Cluster: one engine process writes a prefix into a real 3-master
cluster (a replica each; the shared ``redis_cluster`` of tests/integrations/conftest.py), another
engine process reads it, and its greedy tokens are those of a single engine.

The writer (lossless, into the cluster; prompt A, computed cold: the single-engine reference), then
the reader (read-only, the same cluster and namespace; A, then B, which shares A's first 300 tokens).
B's tokens are not compared: a partial hit computes the rest of the prompt in other matmul shapes
than a full prefill, and greedy decoding follows the rounding (measured: the first token differed)."""
import uuid

import pytest
from test_connector import BS, _prompts, _spec, _wait

pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gemma_hf_dir, redis_cluster):
    import os

    tmp = tmp_path_factory.mktemp("vllm-cluster")
    A, B, _ = _prompts(gemma_hf_dir)
    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = cores[0], cores[-1]
    ns = "vllm-" + uuid.uuid4().hex[:8]
    store = {"store": redis_cluster.url, "namespace": ns, "lossless": True}
    out = _wait({"writer": _spec(tmp, "writer", gemma_hf_dir, [A], store, c1)})
    out.update(_wait({"reader": _spec(tmp, "reader", gemma_hf_dir, [A, B], {**store, "read_only": True}, c0,
                                      kl_reference="writer")}))
    out["_A"], out["_B"], out["_ns"] = A, B, ns
    return out


def test_reader_engine_gives_the_single_engine_tokens(runs):
    w, r = runs["writer"]["results"], runs["reader"]["results"]
    A = runs["_A"]
    assert w[0]["cached_tokens"] == 0  # the writer computed A itself: what one engine alone gives
    assert r[0]["cached_tokens"] == (len(A) - 1) // BS * BS == 512  # every full block of A from the cluster
    assert r[0]["tokens"] == w[0]["tokens"], "the second engine's greedy tokens differ from a single engine's"
    assert r[0]["kl_vs_reference"] is not None and r[0]["kl_vs_reference"] < 0.01, r[0]["kl_vs_reference"]
    assert r[1]["cached_tokens"] == 300 // BS * BS == 256  # B: the block-aligned prefix it shares with A
    assert runs["reader"]["connector"]["timings"]["loaded_blocks"] == 4 + 2
    warned = [x for x in runs["reader"]["warnings"] + runs["writer"]["warnings"]
              if x.startswith(("KvzVllmWarning", "Store"))]  # "Category: message"
    assert not warned, warned


def test_the_prefix_lives_in_the_cluster(runs, redis_cluster):
    """The writer's run is an entry of the namespace on the cluster (one slot on one master), and the
    reader found it there, not in anything the two processes share besides the cluster."""
    from kvz.integrations.kvstore import open_url

    s = open_url(f"{redis_cluster.url}?namespace={runs['_ns']}")
    try:
        keys = s.keys()
        written = [x["key"] for x in runs["writer"]["connector"]["runs"]]
        assert written and set(written) <= set(keys), (written, keys)
        for k in written:
            assert redis_cluster.master_of_key(s.entry_key(k)) in redis_cluster.masters()
        assert runs["reader"]["connector"].get("runs", []) == []  # read-only: it stored nothing
    finally:
        s.close()
