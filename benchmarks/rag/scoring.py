"""Scoring short answers: the SQuAD normalisation, exact match, token F1, and a paired bootstrap.

Pure functions (no model): :func:`normalize_answer` is SQuAD v1.1's (lower case, punctuation and the
articles a/an/the removed, whitespace collapsed); :func:`exact_match` and :func:`token_f1` take the
best over the gold answers; :func:`answer_text` cuts a generated continuation to its first line;
:func:`paired_bootstrap` is the 95% interval of a method's mean score minus the reference's over the
same questions, questions resampled with replacement.
"""
from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np

__all__ = ["normalize_answer", "exact_match", "token_f1", "answer_text", "paired_bootstrap"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces.

    >>> normalize_answer("The  Vellum Archive!")
    'vellum archive'
    """
    s = "".join(ch for ch in str(s).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _golds(gold) -> list:
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match(pred: str, gold) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer (``gold``: a string or a list)."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _golds(gold)))


def _f1(pred: str, gold: str) -> float:
    pt, gt = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pt or not gt:
        return float(pt == gt)
    common = sum((Counter(pt) & Counter(gt)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(pt), common / len(gt)
    return 2 * prec * rec / (prec + rec)


def token_f1(pred: str, gold) -> float:
    """SQuAD token F1 of the prediction against the best gold answer.

    >>> round(token_f1("Dr. Ilse Varn", ["Ilse Varn"]), 3)
    0.8
    """
    return max(_f1(pred, g) for g in _golds(gold))


def answer_text(text: str) -> str:
    """A generated continuation cut to its answer: the first non-empty line, stripped."""
    for line in str(text).split("\n"):
        if line.strip():
            return line.strip()
    return ""


def paired_bootstrap(x, ref, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """``(mean(x - ref), low, high)``: the paired difference and its bootstrap interval at ``level``.

    ``x`` and ``ref`` are per-question scores of the same questions (same order); each bootstrap draw
    resamples question indices with replacement, so the interval is of the paired difference."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError("x and ref must score the same questions")
    if not len(x):
        return float("nan"), float("nan"), float("nan")
    d = x - ref
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(int(n_boot), len(d)))
    means = d[idx].mean(axis=1)
    a = (1.0 - level) / 2
    return float(d.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))
