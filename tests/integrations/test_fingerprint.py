"""The weights fingerprint in engine store keys (issue 38 item 4): two checkpoints that share a name
never read each other's entries; the same checkpoint copied elsewhere does."""
import os
import shutil

import numpy as np

from kvz.integrations.chunkstore import ChunkStore
from kvz.integrations.fingerprint import weights_fingerprint
from kvz.integrations.kvstore import DirectoryBackend
from kvz.integrations.vllm.store import BlockStore


def _model(d, seed: int, size: int = 3 << 20):
    """A model folder: config.json and a weights file of ``size`` random bytes."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "gemma3_text", "num_hidden_layers": 2}')
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(np.random.default_rng(seed).bytes(size))
    return str(d)


def test_same_weights_same_fingerprint_anywhere(tmp_path):
    a = _model(tmp_path / "a" / "gemma-3-270m", 0)
    b = str(tmp_path / "b" / "gemma-3-270m")
    shutil.copytree(a, b)
    fa = weights_fingerprint(a)
    assert fa is not None and fa == weights_fingerprint(b)
    assert weights_fingerprint(os.path.join(a, "model.safetensors")) not in (None, fa)  # a file, not the folder


def test_changed_weights_or_config_change_it(tmp_path):
    a = _model(tmp_path / "a" / "m", 0)
    fa = weights_fingerprint(a)
    # a fine-tune: every tensor differs (here: all bytes past the header)
    b = _model(tmp_path / "b" / "m", 1)
    assert weights_fingerprint(b) != fa
    # a fine-tune changes every tensor: here one byte in every 2 KiB past the header, same size and name
    c = str(tmp_path / "c" / "m")
    shutil.copytree(a, c)
    path = os.path.join(c, "model.safetensors")
    with open(path, "r+b") as f:
        for off in range(65536, os.path.getsize(path), 2048):
            f.seek(off)
            f.write(b"\xff")
    assert weights_fingerprint(c) != fa
    with open(os.path.join(c, "config.json"), "w") as f:
        f.write('{"model_type": "gemma3_text", "num_hidden_layers": 3}')
    assert weights_fingerprint(c) not in (fa, None)


def test_nothing_local_means_no_fingerprint(tmp_path):
    assert weights_fingerprint(None) is None and weights_fingerprint("") is None
    assert weights_fingerprint(str(tmp_path / "nowhere")) is None
    assert weights_fingerprint("no-such-org/no-such-model-kvz") is None  # an id not in the HF cache: no download
    (tmp_path / "empty").mkdir()
    assert weights_fingerprint(str(tmp_path / "empty")) is None


def test_block_store_keys_bind_the_weights(tmp_path):
    kw = dict(model_id="gemma-3-270m", block_size=4, layer_types=["full_attention"] * 2, rope_theta=[1e4] * 2,
              shape=(2, 1, 8), dtype="float32", eps=0.02, threads=1)
    be = DirectoryBackend(str(tmp_path / "s"))
    ids = list(range(8))
    plain = BlockStore(be, **kw)
    assert "weights" not in plain.binding  # nothing to fingerprint: the keys it always had
    w1, w2 = (BlockStore(be, weights=w, **kw) for w in ("w0123456789abcdef", "wfedcba9876543210"))
    assert w1.binding["weights"] == "w0123456789abcdef"
    keys = [s.block_hashes(ids, 2) for s in (plain, w1, w2)]
    assert all(set(x).isdisjoint(y) for i, x in enumerate(keys) for y in keys[i + 1:])
    assert BlockStore(be, weights="w0123456789abcdef", **kw).block_hashes(ids, 2) == keys[1]


def test_chunk_store_keys_bind_the_weights(tmp_path):
    from alignpred.cache.rope import RopeSpec

    kw = dict(model_id="synthetic", layer_types=["full_attention"] * 2, rope=RopeSpec.from_thetas([1e4] * 2, head_dim=8),
              shape=(2, 1, 8), codec="raw", chunk_tokens=4)
    be = DirectoryBackend(str(tmp_path / "c"))
    a, b = (ChunkStore(be, weights=w, **kw).chunks(list(range(8))) for w in ("w1111111111111111", "w2222222222222222"))
    assert all(x.prefix_key != y.prefix_key and x.content_key != y.content_key for x, y in zip(a, b))
