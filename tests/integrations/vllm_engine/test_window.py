"""Windowed loads in vLLM's own engine (kvz.integrations.vllm.window): on a 1,280-token hit of Gemma 3
270M, the 15 sliding-window layers (window 512) are decoded from position 640 only and zeros are
written before it; the full-attention layers whole. The greedy tokens equal the writer's (a full
prefill), and ``window_loads: off`` decodes everything (in kvz's decode process: the engine's
test of that path; the default decodes in the load thread).

Lossless ``fast`` store (no linear maps: the windowed decode skips work, and the loaded blocks are
the writer's bits exactly, so the comparison is bit for bit)."""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_connector import BS, TEXTS, _spec, _wait

pytestmark = pytest.mark.timeout(1800)

N_PROMPT = 1400
HIT = (N_PROMPT - 1) // BS * BS  # 1280
START = HIT - BS - 512  # 640: the first position a sliding layer's load decodes


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gemma_hf_dir):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("vllm-window")
    tok = AutoTokenizer.from_pretrained(gemma_hf_dir)
    ids = tok.encode((TEXTS / "english-technical.txt").read_text(), add_special_tokens=False)
    assert len(ids) >= N_PROMPT
    prompt = [2] + ids[:N_PROMPT - 1]
    cores = sorted(os.sched_getaffinity(0))
    store = str(tmp / "store")
    base = {"store": store, "lossless": True, "profile": "fast"}
    r = _wait({"write": _spec(tmp, "write", gemma_hf_dir, [prompt], {**base, "debug_dir": str(tmp / "dbg-w")},
                              cores[0], max_model_len=1536)})
    r.update(_wait({
        "window": _spec(tmp, "window", gemma_hf_dir, [prompt], {**base, "read_only": True,
                                                                 "debug_dir": str(tmp / "dbg-on")},
                        cores[0], "write", max_model_len=1536),
        "whole": _spec(tmp, "whole", gemma_hf_dir, [prompt], {**base, "read_only": True, "window_loads": "off",
                                                               "decode_process": True,  # the other decode path
                                                               "debug_dir": str(tmp / "dbg-off")},
                       cores[-1], "write", max_model_len=1536)}))
    r["_tmp"] = tmp
    return r


def _dump(d, what):
    files = sorted(d.glob(f"{what}-*"), key=os.path.getmtime)
    assert files, f"no {what} dump in {d}"
    return load_file(str(files[0]))


def test_windowed_hit_same_tokens(runs):
    ref = runs["write"]["results"][0]
    for name in ("window", "whole"):
        got = runs[name]["results"][0]
        assert got["cached_tokens"] == HIT, (name, got["cached_tokens"])
        assert got["tokens"] == ref["tokens"], name
    assert "decoded from their window" in runs["window"]["connector"]["stats"]["window_loads"]
    assert runs["whole"]["connector"]["stats"]["window_loads"] == "window_loads off"
    # the default decodes in the load thread; "whole" in kvz's decode process (decode_process: true)
    assert not runs["window"]["connector"]["stats"]["decode_process"]
    dp = runs["whole"]["connector"]["stats"]["decode_process"]
    assert dp and dp.get("error") is None, dp


def test_windowed_blocks(runs):
    tmp = runs["_tmp"]
    saved = _dump(tmp / "dbg-w", "save")
    on, off = _dump(tmp / "dbg-on", "load"), _dump(tmp / "dbg-off", "load")
    sliding = 0
    for k, exact in saved.items():
        layer = int(k.split(".")[1])
        assert np.array_equal(off[k], exact[:, :HIT]), k
        if layer % 6 == 5:  # full attention: whole
            assert np.array_equal(on[k], exact[:, :HIT]), k
        else:
            sliding += 1
            assert not on[k][:, :START].any(), k
            assert np.array_equal(on[k][:, START:], exact[:, START:HIT]), k
    assert sliding == 30
