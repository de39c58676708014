"""The questions of the RAG benchmark: documents cut from real text, planted facts, prompts, MuSiQue.

* :func:`split_units` / :func:`make_documents` — a pool of documents of about ``doc_tokens`` tokens,
  consecutive windows of sentences (or lines) of the given text files, round-robin over the files;
* :func:`plant_facts` — one invented fact per document (``"The access code for the Vellum archive is
  4817."``) inserted between two of its sentences, with its question and gold answers; the names are
  made-up words, so only the document can answer;
* :func:`cloze_question` — a question about what the text itself says: the word that follows a
  five-word run of the document;
* :func:`build_questions` — ``n`` questions: a topic (an ordered list of ``docs_per_prompt`` documents
  from the pool, topics overlapping so documents recur at other positions) drawn Zipf-like, its order
  shuffled with probability ``shuffle_p``, a question about one of its documents;
* :func:`assemble` — token ids and chunk boundaries of a prompt: BOS + instructions with a worked
  example (a shared prefix) + each document led by the ``"\\n\\n"`` separator + the question; boundaries
  on each separator (``"sep"``) or on the document's first token (``"first"``);
* :func:`musique_questions` — the MuSiQue subset (``ctxs``, ``question``, ``answers``): the first
  ``passages`` passages, each cut to ``passage_tokens``, in an order varied per question.

Everything is deterministic in ``seed`` (numpy's ``default_rng``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

__all__ = ["INSTRUCTIONS", "split_units", "make_documents", "plant_facts", "cloze_question", "build_questions",
           "assemble", "musique_questions", "text_paths"]

INSTRUCTIONS = ("Answer the question with a few words copied from the documents.\n\n"
                "Document: The harbour office of Pellin opens at nine. The capital of the Norlan region is "
                "Bexhill.\n\nQuestion: What is the capital of the Norlan region?\nAnswer: Bexhill")

_SYL = ("ba", "dor", "vel", "ka", "mir", "tho", "len", "sar", "qui", "ro", "zen", "fal", "mo", "tri", "gan",
        "pel", "ost", "wy", "lum", "che", "nar", "ib", "ur", "sten")
_COLOURS = ("crimson", "teal", "amber", "violet", "ochre", "silver", "indigo", "olive")
# (fact sentence, question, gold answers); {X}: an invented name, {N}: a number, {P} a person, {T} a town
_TEMPLATES = (
    ("The access code for the {X} archive is {N4}.", "What is the access code for the {X} archive?", ("{N4}",)),
    ("The {X} expedition was led by {P}.", "Who led the {X} expedition?", ("{P}",)),
    ("The {X} festival is held every spring in the town of {T}.", "In which town is the {X} festival held?",
     ("{T}",)),
    ("The {X} bridge is {N3} metres long.", "How long is the {X} bridge?", ("{N3} metres", "{N3}")),
    ("The official colour of the {X} guild is {C}.", "What is the official colour of the {X} guild?", ("{C}",)),
)


def text_paths(text_dirs=()) -> list:
    """The bundled real texts (``samples/texts``, ``samples/texts/eval``) and the ``*.txt`` / ``*.md`` files
    of ``text_dirs``."""
    from kvz.benchmarks.prompts import text_files

    out = [p for _, p in text_files("eval")]
    for d in text_dirs:
        out += sorted(p for p in Path(d).rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
    return out


def split_units(text: str) -> list:
    """Sentences (split after ``.!?`` and a space) and lines of ``text``, stripped, non-empty."""
    return [u.strip() for u in re.split(r"(?<=[.!?])\s+|\n+", text) if u.strip()]


def make_documents(tok, paths, n_docs: int, doc_tokens: int = 120) -> list:
    """``n_docs`` documents ``[{"units": [...], "source": name}]``: consecutive runs of units of each
    file until ``doc_tokens`` tokens, taken round-robin over ``paths`` (each file continues where its
    previous document ended; a file that runs out starts again)."""
    files = []
    for p in paths:
        units = split_units(Path(p).read_text(encoding="utf-8"))
        units = [u for u in units if len(u) < 600]
        if len(units) >= 4:
            files.append((Path(p).name, units, [len(tok(u, add_special_tokens=False)["input_ids"]) for u in units]))
    if not files:
        raise ValueError("no usable text files")
    pos = [0] * len(files)
    docs = []
    while len(docs) < n_docs:
        f = len(docs) % len(files)
        name, units, ntok = files[f]
        got, n = [], 0
        while n < doc_tokens:
            i = pos[f] % len(units)
            got.append(units[i])
            n += ntok[i] + 1
            pos[f] += 1
        docs.append({"units": got, "source": name})
    return docs


def _name(rng, syl=2) -> str:
    return "".join(_SYL[int(i)] for i in rng.integers(0, len(_SYL), size=syl)).capitalize()


def plant_facts(docs, seed: int = 0) -> list:
    """One invented fact per document, inserted after one of its units (never before the first);
    returns ``[{"doc", "fact", "question", "answers", "kind": "planted"}]`` and sets ``doc["text"]``."""
    rng = np.random.default_rng(seed)
    used: set = set()
    facts = []
    for k, d in enumerate(docs):
        fact_t, q_t, a_t = _TEMPLATES[k % len(_TEMPLATES)]
        x = _name(rng)
        while x in used:
            x = _name(rng, 3)
        used.add(x)
        vals = {"X": x, "N4": str(int(rng.integers(1000, 10000))), "N3": str(int(rng.integers(120, 990))),
                "P": f"{_name(rng)} {_name(rng)}", "T": _name(rng), "C": _COLOURS[int(rng.integers(len(_COLOURS)))]}
        fact = fact_t.format(**vals)
        at = int(rng.integers(1, len(d["units"])))
        d["text"] = " ".join(d["units"][:at] + [fact] + d["units"][at:])
        facts.append({"doc": k, "fact": fact, "question": q_t.format(**vals),
                      "answers": [a.format(**vals) for a in a_t], "kind": "planted"})
    return facts


def cloze_question(doc: dict, k: int, rng) -> dict | None:
    """The word after a five-word run of the document's own text (words of letters only), or None."""
    words = doc["text"].split()
    ok = [i for i in range(5, len(words)) if re.fullmatch(r"[A-Za-z]{4,}", words[i].strip(".,;:!?\"'()"))
          and all(re.fullmatch(r"[\w,'\-]+[.,;:]?", w) for w in words[i - 5:i])]
    if not ok:
        return None
    i = int(ok[int(rng.integers(len(ok)))])
    run = " ".join(words[i - 5:i])
    if doc["text"].count(run) != 1:
        return None
    ans = words[i].strip(".,;:!?\"'()")
    return {"doc": k, "question": f'Which word comes right after "{run}"?', "answers": [ans], "kind": "text"}


def build_questions(docs, facts, n: int, *, n_topics: int = 40, docs_per_prompt: int = 3, shuffle_p: float = 0.5,
                    text_share: float = 0.25, seed: int = 0) -> list:
    """``n`` questions ``[{"id", "docs" (order in the prompt), "topic", "question", "answers", "kind",
    "gold_doc"}]``: a topic drawn with weights ``1/rank^0.6``, shuffled with probability ``shuffle_p``,
    a planted-fact question (or with probability ``text_share`` a cloze one) about one of its documents."""
    rng = np.random.default_rng(seed + 1)
    n_docs = len(docs)
    topics = [[int(x) for x in rng.choice(n_docs, size=docs_per_prompt, replace=False)] for _ in range(n_topics)]
    w = 1.0 / np.arange(1, n_topics + 1) ** 0.6
    w /= w.sum()
    out = []
    while len(out) < n:
        t = int(rng.choice(n_topics, p=w))
        order = list(topics[t]) if rng.random() >= shuffle_p else [int(x) for x in rng.permutation(topics[t])]
        g = order[int(rng.integers(len(order)))]
        q = cloze_question(docs[g], g, rng) if rng.random() < text_share else None
        q = q or facts[g]
        out.append({"id": len(out), "docs": order, "topic": t, "question": q["question"], "answers": q["answers"],
                    "kind": q["kind"], "gold_doc": g})
    return out


def assemble(tok, texts, question: str, *, boundary: str = "sep", head: str = "Document: ") -> dict:
    """``{"ids", "boundaries"}`` of BOS + :data:`INSTRUCTIONS` + each text (led by ``"\\n\\n"`` and
    ``head``) + ``"\\n\\nQuestion: ...\\nAnswer:"``; a boundary before each text and before the question,
    on the separator (``"sep"``) or after it (``"first"``)."""
    if boundary not in ("sep", "first"):
        raise ValueError("boundary must be sep or first")

    def enc(s):
        return list(tok(s, add_special_tokens=False)["input_ids"])

    sep = enc("\n\n")
    ids = [tok.bos_token_id] + enc(INSTRUCTIONS)
    bounds = []
    for body in [head + t for t in texts] + [f"Question: {question}\nAnswer:"]:
        bounds.append(len(ids) + (len(sep) if boundary == "first" else 0))
        ids += sep + enc(body)
    return {"ids": ids, "boundaries": bounds}


def musique_questions(path, tok, *, limit: int = 30, passages: int = 3, passage_tokens: int = 200,
                      seed: int = 0) -> list:
    """The MuSiQue subset's first ``limit`` questions: ``[{"id", "question", "answers", "passages"
    (texts, in a per-question order), "kind": "musique"}]``; each passage is ``title: text`` cut to
    ``passage_tokens`` tokens, the first ``passages`` of the retrieved ten."""
    rng = np.random.default_rng(seed)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for i, q in enumerate(data[:limit]):
        ps = []
        for c in q["ctxs"][:passages]:
            ids = tok(f"{c['title']}: {c['text']}", add_special_tokens=False)["input_ids"][:passage_tokens]
            ps.append(tok.decode(ids))
        order = [int(x) for x in rng.permutation(len(ps))]
        out.append({"id": i, "question": q["question"], "answers": list(q["answers"]),
                    "passages": [ps[j] for j in order], "kind": "musique"})
    return out
