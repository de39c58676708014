"""Repair of content hits (integrations/chunkstore/repair.py): seams derived from the chunk layout,
deviation-guided recomputation, separator-derived boundaries, and the engine's defaults.

Uses the tiny random-weight Gemma 3 of tests/integrations/test_hf_bridge.py (fast, CI's default pass)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from kvz.integrations.chunkstore import ChunkStore, Hit, ReuseEngine, separator_boundaries
from kvz.integrations.chunkstore.keys import Chunk
from kvz.integrations.chunkstore.repair import guided_select, seam_mask, seam_starts
from kvz.integrations.kvstore import DirectoryBackend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hit(start, end, kind, src):
    return Hit(Chunk(0, start, end, "p", "c"), kind, b"", src, "k")


def test_seams_derived_from_the_chunk_layout():
    hits = [_hit(0, 20, "prefix", 0), _hit(20, 36, "content", 50), _hit(36, 52, "content", 66),  # one stored text
            _hit(52, 60, "content", 10),  # another stored text: a seam
            _hit(70, 80, "content", 80)]  # after a miss: a seam
    assert seam_starts(hits) == [20, 52, 70]
    m = seam_mask(hits, 90, 20)  # R runs on into the next chunk of the same stored text, not past a hit's end
    assert np.nonzero(m)[0].tolist() == list(range(20, 40)) + list(range(52, 60)) + list(range(70, 80))


def test_guided_select_threshold_and_cap():
    cand = np.array([3, 5, 8, 9, 12])
    dev = np.array([0.01, 0.3, 0.2, 0.05, 0.5])
    assert guided_select(cand, dev, 0.1).tolist() == [5, 8, 12]
    assert guided_select(cand, dev, 0.1, max_frac=0.4).tolist() == [5, 12]
    assert guided_select(cand, dev, 1.0).tolist() == []


def test_separator_boundaries():
    assert separator_boundaries([1, 2, 9, 9, 3, 4, 5, 9, 6], {9}, min_segment=2) == [2, 7]
    assert separator_boundaries([9, 1, 9], {9}, min_segment=1) == [2]  # never at 0
    assert separator_boundaries([1, 2, 3], set()) == []


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    sys.path.insert(0, os.path.join(ROOT, "tests", "integrations"))
    from test_hf_bridge import tiny_gemma

    return tiny_gemma()


def _store(model, path):
    return ChunkStore.for_model(model, DirectoryBackend(str(path)), codec="raw", raw_dtype="float32", chunk_tokens=16,
                                max_positions=1024)


def _ids(n, seed):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_guided_repair_between_none_and_full(tiny, tmp_path):
    """Threshold 0 recomputes every content token (up to the cap), an infinite one none; the defaults
    are the measured setting (seam + guided)."""
    eng = ReuseEngine(tiny, _store(tiny, tmp_path / "s"), R=4)
    assert eng.repair == "seam+guided"
    doc = _ids(48, 1)
    eng.generate([1] + _ids(15, 2) + doc, 2, boundaries=[16])
    ids2 = [1] + _ids(20, 3) + doc + _ids(5, 4)
    full = eng.prefill(ids2, reuse="none")

    def err(res):
        return sum(float((a - b).norm() / b.norm()) for (a, _), (b, _) in zip(res.kv, full.kv))

    kw = dict(boundaries=[21, 69], repair="guided")
    all_ = eng.prefill(ids2, threshold=0.0, max_frac=1.0, **kw)
    none = eng.prefill(ids2, threshold=float("inf"), **kw)
    capped = eng.prefill(ids2, threshold=0.0, max_frac=0.25, **kw)
    assert all_.stats["repaired_tokens"] == 48 and none.stats["repaired_tokens"] == 0
    assert capped.stats["repaired_tokens"] == 12
    assert err(all_) < 1e-4 < err(capped) < err(none)
    d = eng.prefill(ids2, boundaries=[21, 69])  # the defaults: seam R=4, then guided
    assert d.stats["repaired_tokens"] >= 4 and err(d) < err(eng.prefill(ids2, boundaries=[21, 69], repair="none"))


def test_boundaries_from_separators(tiny, tmp_path):
    """Without caller boundaries, an engine given separator ids derives them: a document led by a
    separator gets content hits wherever it lands."""
    SEP = 250
    eng = ReuseEngine(tiny, _store(tiny, tmp_path / "s"), separators=[SEP], min_segment=8)
    doc = [SEP] + _ids(40, 5)
    eng.generate([1] + _ids(12, 6) + doc + [SEP] + _ids(6, 7), 2)
    res = eng.prefill([1] + _ids(27, 8) + doc + [SEP] + _ids(6, 9))
    assert res.stats["n_content_hits"] == 3 and res.stats["content_tokens"] == 41  # the doc: 16 + 16 + 9
    plain = ReuseEngine(tiny, _store(tiny, tmp_path / "s2"))
    plain.generate([1] + _ids(12, 6) + doc + [SEP] + _ids(6, 7), 2)
    assert plain.prefill([1] + _ids(27, 8) + doc + [SEP] + _ids(6, 9)).stats["n_content_hits"] == 0


def test_reuse_repair_acceptance_checks():
    """benchmarks/reuse_repair.py's acceptance table: each point is checked against prefix reuse and
    FP8 on the same prompts, and fails when it should."""
    from kvz.benchmarks.reuse_repair import acceptance

    def row(i, ttft, kl, ident, content):
        return {"prompt": i, "ttft_s": ttft, "ttft_ratio": ttft, "reuse_frac": 0.5, "identical": ident, "kl_mean": kl,
                "computed_tokens": 10, "repaired_tokens": 0, "content_tokens": content, "probe_s": 0.0,
                "first_div": None}

    per = {"prefix": [row(i, 0.5, 1e-3, True, 0) for i in range(4)],
           "fp8-same-positions": [row(i, 0.5, 2e-3, i != 0, 0) for i in range(4)]}
    good = [row(i, 0.2, 1e-3, True, 5 * (i > 1)) for i in range(4)]
    bad = [row(i, 0.4, 3e-3, i == 0, 5 * (i > 1)) for i in range(4)]
    out = {"per_prompt": per, "sweep_rows": {"c256": {"good": good, "bad": bad}}}
    got = {(r["subset"], r["setting"]): r for r in acceptance(out)}
    assert set(got) == {(s, n) for s in ("all", "content-hit prompts") for n in ("good", "bad")}
    g, b = got["all", "good"], got["all", "bad"]
    assert g["ttft_ok"] and g["kl_ok"] and g["kl_fp8_ok"] and g["ident_ok"] and g["prefix_identical"] == 4
    assert not (b["ttft_ok"] or b["kl_ok"] or b["kl_fp8_ok"] or b["ident_ok"])
    assert got["content-hit prompts", "good"]["n"] == 2 and got["content-hit prompts", "bad"]["identical"] == 0
