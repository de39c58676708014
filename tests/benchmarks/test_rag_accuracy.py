"""The RAG accuracy benchmark without the model: scoring (SQuAD EM / F1), the paired bootstrap, the
questions built from the bundled texts (deterministic, answerable from their documents), prompt
assembly and boundaries, and the summary rows."""
from __future__ import annotations

import numpy as np
import pytest

from kvz.benchmarks.rag.scoring import answer_text, exact_match, normalize_answer, paired_bootstrap, token_f1
from kvz.benchmarks.rag.tasks import (
    assemble,
    build_questions,
    cloze_question,
    make_documents,
    plant_facts,
    split_units,
    text_paths,
)
from kvz.benchmarks.rag_accuracy import method_list, summarize


class _Tok:
    """A character tokenizer (one id per character, decodable): enough to count and cut tokens."""
    bos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) + 10 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 10) for i in ids if i >= 10)


def test_squad_normalisation_and_scores():
    assert normalize_answer("  The Vellum, archive!") == "vellum archive"
    assert exact_match("4817.", ["4817"]) == 1.0
    assert exact_match("An amber", "amber") == 1.0
    assert exact_match("4818", ["4817"]) == 0.0
    assert token_f1("Ilse Varn", ["Varn"]) == pytest.approx(2 / 3)
    assert token_f1("756 metres long", ["756 metres", "756"]) == pytest.approx(0.8)
    assert token_f1("", ["x"]) == 0.0 and token_f1("the", ["a"]) == 1.0  # both empty after normalisation
    assert answer_text("\n  Bexhill\n\nQuestion: x") == "Bexhill"


def test_paired_bootstrap():
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 2, 300).astype(float)
    d, lo, hi = paired_bootstrap(ref, ref)
    assert d == lo == hi == 0.0
    x = ref.copy()
    x[np.nonzero(ref)[0][:30]] = 0.0  # 30 of 300 answers lost: -0.1 exactly
    d, lo, hi = paired_bootstrap(x, ref, n_boot=4000)
    assert d == pytest.approx(-0.1) and lo < d < hi < 0.0 and hi - lo < 0.1
    assert paired_bootstrap(x, ref, seed=3) == paired_bootstrap(x, ref, seed=3)
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0])


def _workload(seed=0):
    tok = _Tok()
    docs = make_documents(tok, text_paths(), 12, doc_tokens=300)
    facts = plant_facts(docs, seed=seed)
    return tok, docs, facts, build_questions(docs, facts, 40, n_topics=8, seed=seed)


def test_questions_are_deterministic_and_answerable():
    tok, docs, facts, qs = _workload()
    assert len(docs) == 12 and len({d["source"] for d in docs}) >= 6  # round-robin over the bundled texts
    for f in facts:
        assert f["fact"] in docs[f["doc"]]["text"] and f["answers"][0] in f["fact"]
    assert len({f["question"] for f in facts}) == len(facts)
    for q in qs:
        assert q["gold_doc"] in q["docs"] and len(set(q["docs"])) == 3
        assert any(a in docs[q["gold_doc"]]["text"] for a in q["answers"])
    assert {q["kind"] for q in qs} == {"planted", "text"}
    orders = {tuple(q["docs"]) for q in qs}
    assert len({frozenset(o) for o in orders}) < len(orders)  # the same documents in another order
    _, docs2, _, qs2 = _workload()
    assert [d["text"] for d in docs2] == [d["text"] for d in docs] and qs2 == qs
    assert _workload(seed=1)[3] != qs


def test_cloze_question_is_the_next_word():
    doc = {"text": " ".join(split_units("It was a bright cold day in April, and the clocks were striking thirteen."))}
    q = cloze_question(doc, 0, np.random.default_rng(0))
    run = q["question"].split('"')[1]
    assert doc["text"].split(run, 1)[1].split()[0].strip(".,") == q["answers"][0]


def test_assemble_boundaries_lead_each_document():
    tok = _Tok()
    sep = tok("\n\n")["input_ids"]
    a = assemble(tok, ["alpha beta", "gamma"], "Which?")
    b = assemble(tok, ["alpha beta", "gamma"], "Which?", boundary="first")
    assert a["ids"] == b["ids"] and a["ids"][0] == tok.bos_token_id and len(a["boundaries"]) == 3
    for x, y in zip(a["boundaries"], b["boundaries"]):
        assert a["ids"][x:x + len(sep)] == sep and y == x + len(sep)
    assert tok.decode(a["ids"][a["boundaries"][1]:a["boundaries"][2]]) == "\n\nDocument: gamma"
    # the same document lands at another position with the same tokens (a content hit)
    c = assemble(tok, ["gamma", "alpha beta"], "Which?")
    n = a["boundaries"][2] - a["boundaries"][1]
    assert c["ids"][c["boundaries"][0]:c["boundaries"][0] + n] == a["ids"][a["boundaries"][1]:a["boundaries"][2]]
    with pytest.raises(ValueError):
        assemble(tok, ["x"], "q", boundary="middle")


def test_methods_and_summary_rows():
    ms = method_list("none,seam:32", "kvz", "c128,first", kvboost=True)
    names = [m["name"] for m in ms]
    assert names[:3] == ["full", "prefix", "kvz"] and "content:none" in names and "kvz:seam:32" in names
    assert {"cacheblend:0.15", "cacheblend@kvz", "lossless:kvz", "kvz-c128", "kvz-first", "kvboost"} <= set(names)
    blend = next(m for m in ms if m["name"] == "cacheblend:0.15")["kw"]
    assert blend["repair"] == "blend" and blend["blend_ratio"] == 0.15
    base = {"ttft_s": 1.0, "recomputed_frac": 1.0, "identical": True, "kl": None, "agree": 1.0, "agree_f1": 1.0}
    per = {"full": [dict(base, q=i, em=1.0, f1=1.0, ttft_ratio=1.0) for i in range(4)],
           "kvz": [dict(base, q=i, em=float(i != 0), f1=float(i != 0), ttft_ratio=0.3, ttft_s=0.3,
                        identical=i != 0, kl=0.01) for i in range(4)]}
    rows = {r["method"]: r for r in summarize(per, ["full", "kvz", "kvboost"], {"kvboost": "ImportError: x"})}
    assert rows["kvz"]["exact_match"] == 75.0 and rows["kvz"]["em_diff"][0] == pytest.approx(-25.0)
    assert rows["kvz"]["ttft_ratio"] == 0.3 and rows["kvz"]["identical"] == 3 and rows["kvz"]["n"] == 4
    assert rows["kvboost"]["n"] == 0 and rows["kvboost"]["status"] == "ImportError: x"
