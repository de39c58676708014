"""Prompts of the quality benchmarks: windows of the bundled texts (held-out or calibration), BOS first."""
from __future__ import annotations

import glob
from pathlib import Path

from .harness import ROOT
from .lm import model

TEXT_SOURCES = {
    "eval": ("samples/texts/*.txt", "samples/texts/eval/*.txt"),
    "calib": ("samples/gemma3-270m/calib_texts/*.txt",),
}
MAX_PROMPT_TOKENS = 500  # default HF cache keeps the last 511 positions of sliding layers; stay below


def text_files(sources) -> list[tuple[str, Path]]:
    """``[(split, path)]`` of the texts of ``sources`` (``"eval"``, ``"calib"``, ``"all"`` or a tuple)."""
    if isinstance(sources, str):
        sources = ("eval", "calib") if sources == "all" else (sources,)
    out = []
    for split in sources:
        if split not in TEXT_SOURCES:
            raise ValueError(f"unknown text source {split!r}; use {', '.join(TEXT_SOURCES)} or 'all'")
        for pat in TEXT_SOURCES[split]:
            out += [(split, Path(p)) for p in sorted(glob.glob(str(Path(ROOT) / pat)))]
    return out


def default_prompts(n: int = 20, tokens: int = 256, *, sources="eval", tokenizer=None) -> list[dict]:
    """``n`` prompts of ``tokens`` tokens (BOS + a window of ``tokens - 1`` document tokens), spread round-robin
    over the documents of ``sources`` (``"eval"``: samples/texts/*.txt and samples/texts/eval/* - held out from
    calibration; ``"calib"``: samples/gemma3-270m/calib_texts/*; ``"all"``); windows of one document are evenly
    spaced and do not overlap when the document is long enough.  Returns dicts with ``kind`` (document name),
    ``source`` (repo-relative path), ``split``, ``start`` (token offset in the document) and ``token_ids``."""
    if not 2 <= tokens <= MAX_PROMPT_TOKENS:
        raise ValueError(f"tokens must be in 2..{MAX_PROMPT_TOKENS} (sliding layers keep 511 positions)")
    if n < 1:
        raise ValueError("n must be >= 1")
    if tokenizer is None:
        tokenizer = model()[1]
    files = text_files(sources)
    if not files:
        raise FileNotFoundError(f"no texts for sources {sources!r} under {ROOT}")
    docs = []
    for split, p in files:
        ids = list(tokenizer(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        bos = tokenizer.bos_token_id
        if ids and ids[0] == bos:
            ids = ids[1:]
        docs.append((split, p, ids))
    per = [n // len(docs) + (1 if i < n % len(docs) else 0) for i in range(len(docs))]
    w = tokens - 1
    prompts_by_doc = []
    for (split, p, ids), k in zip(docs, per):
        if k == 0:
            prompts_by_doc.append([])
            continue
        if len(ids) < w:
            raise ValueError(f"{p} has {len(ids)} tokens, fewer than the {w} a window needs")
        span = len(ids) - w
        # evenly spaced from the document's start to its end (disjoint when span >= (k - 1) * w)
        starts = [round(i * span / (k - 1)) for i in range(k)] if k > 1 else [0]
        rel = str(p.relative_to(Path(ROOT)))
        prompts_by_doc.append([{"kind": p.stem, "source": rel, "split": split, "start": s,
                                "token_ids": [tokenizer.bos_token_id] + ids[s:s + w]} for s in starts])
    out = []
    for r in range(max(per)):  # round-robin so a prefix of the list still covers every kind
        out += [ps[r] for ps in prompts_by_doc if r < len(ps)]
    return out
