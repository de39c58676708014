"""The workload of the chunk-reuse benchmark (:mod:`kvz.benchmarks.reuse`): prompts of recurring documents
of the bundled texts under a system prompt, each with a question; the reference a served prompt is scored
against (teacher-forced KL, FP8 on the same positions); and the benchmark's Markdown report."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from .harness import ROOT

TEXTS = ["samples/texts/english-prose.txt", "samples/texts/german-prose.txt", "samples/texts/python-code.txt",
         "samples/texts/eval/english-story.txt", "samples/texts/eval/markdown-shell-json.txt",
         "samples/gemma3-270m/calib_texts/english-technical.txt", "samples/gemma3-270m/calib_texts/french-prose.txt",
         "samples/gemma3-270m/calib_texts/math-proofs.txt", "samples/gemma3-270m/calib_texts/c-code.txt"]
SYSTEM = ("You are a careful assistant. Answer the question using only the documents below. Quote the "
          "document you rely on, say so when the documents do not contain the answer, and keep the answer short.")
QUESTIONS = ["What is the main point of the first document?", "Which document mentions a number, and what is it?",
             "Summarize the second document in one sentence.", "What do the documents have in common?",
             "Which names appear in the documents?", "What would a reader learn from the last document?",
             "Is there any code in the documents? Describe it.", "What is the tone of the documents?",
             "List three key terms from the documents.", "Which document is the most technical, and why?",
             "What question does the first document leave open?", "Translate the first sentence of any document.",
             "What happens at the end of the story, if there is one?", "Give a title to each document.",
             "Which claim in the documents is the most surprising?", "Explain one term a beginner would not know."]


def build_workload(tok, *, n_prompts=50, n_docs=9, n_topics=6, docs_per_prompt=3, doc_tokens=256, shuffle_p=0.3,
                   seed=0) -> dict:
    """Prompts ``[{"ids", "boundaries", "docs", "topic", "question"}]`` and the document pool."""
    rng = np.random.default_rng(seed)
    head = tok("Document:\n", add_special_tokens=False)["input_ids"]
    docs = []
    for k in range(n_docs):
        path = Path(ROOT) / TEXTS[k % len(TEXTS)]
        body = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        w = doc_tokens - len(head)
        start = (k // len(TEXTS)) * (w + 17) + 5
        if start + w > len(body):
            start = max(0, len(body) - w)
        docs.append(head + body[start:start + w])
    sys_ids = [tok.bos_token_id] + tok(SYSTEM + "\n\n", add_special_tokens=False)["input_ids"]
    topics = []
    for t in range(n_topics):  # overlapping ordered retrieval lists: documents recur at other positions
        topics.append([int((t + j * (1 + t % 2)) % n_docs) for j in range(docs_per_prompt)])
    weights = 1.0 / np.arange(1, n_topics + 1) ** 0.6
    weights /= weights.sum()
    prompts = []
    for i in range(n_prompts):
        t = int(rng.choice(n_topics, p=weights))
        order = list(topics[t])
        if rng.random() < shuffle_p:
            order = list(rng.permutation(order))
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (request {i})" if i >= len(QUESTIONS) else "")
        q_ids = tok("\nQuestion: " + q + "\nAnswer:", add_special_tokens=False)["input_ids"]
        ids, bounds = list(sys_ids), []
        for dk in order:
            bounds.append(len(ids))
            ids += docs[dk]
        bounds.append(len(ids))
        ids += q_ids
        prompts.append({"ids": ids, "boundaries": bounds, "docs": [int(d) for d in order], "topic": t, "question": q})
    return {"prompts": prompts, "docs": docs, "system_tokens": len(sys_ids), "doc_tokens": doc_tokens}



def _kl_rows(ref_logits, logits):
    """Per-position KL(ref || x) in float64: [n]."""
    lp_ref = ref_logits.double().log_softmax(-1)
    lp = logits.double().log_softmax(-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0.0)


def _tf(model, cache, tokens, start, kw):
    """Teacher-forced logits [len(tokens), vocab] after ``cache`` (positions from ``start``)."""
    import torch

    if not tokens:
        return None
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(start, start + len(tokens))[None],
                    use_cache=True, **{kw: cache})
    return out.logits[0]


def _fp8(x):
    """FP8 e4m3 round trip with one float32 scale (amax / 448) for the tensor."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.float8_e4m3fn)
    mx = float(ml_dtypes.finfo(dt).max)
    amax = float(np.abs(x).max()) if x.size else 0.0
    scale = np.float32(amax / mx if amax > 0 else 1.0)
    return (np.clip(x / scale, -mx, mx).astype(dt).astype(np.float32) * scale).astype(np.float32)


class Ref:
    """The full-recompute run of one prompt: TTFT, greedy path, step logits, a cache to teacher-force other paths."""

    def __init__(self, model, ids, n_new, kw):
        import torch

        from kvz.integrations.hf.bridge import capture_prefill

        self.model, self.kw, self.T, self.last_id = model, kw, len(ids), int(ids[-1])
        t0 = time.perf_counter()
        logits, cache, full_kv = capture_prefill(model, ids)
        first = int(logits[0, -1].argmax())
        self.ttft = time.perf_counter() - t0
        cache.recording = False
        self.full_kv = full_kv
        self.cache0 = copy.deepcopy(cache)
        toks, steps = [first], [logits[0, -1].float().clone()]
        with torch.inference_mode():
            for _ in range(n_new - 1):
                lg = model(input_ids=torch.tensor([[toks[-1]]]), position_ids=torch.tensor([[self.T + len(toks) - 1]]),
                           use_cache=True, **{kw: cache}).logits[0, -1]
                steps.append(lg.float().clone())
                toks.append(int(lg.argmax()))
        self.tokens, self.logits = toks, torch.stack(steps)

    def along(self, path):
        """Reference logits along another greedy path (teacher-forced on a copy of the prefill cache)."""
        import torch

        n = min(len(path), len(self.tokens))
        if path[:n] == self.tokens[:n]:
            return self.logits[:n]
        lg = _tf(self.model, copy.deepcopy(self.cache0), path[:n - 1], self.T, self.kw)
        return torch.cat([self.logits[:1], lg.float()]) if lg is not None else self.logits[:1]


def _score_tf(ref: Ref, first_logits, cache):
    """(identical, kl_mean, first_div) of a strategy's cache along the reference path."""
    import torch

    lg = _tf(ref.model, cache, ref.tokens[:-1], ref.T, ref.kw)
    logits = torch.cat([first_logits[None].float(), lg.float()]) if lg is not None else first_logits[None].float()
    kl = _kl_rows(ref.logits, logits)
    am = logits.argmax(-1).tolist()
    div = next((i for i, (a, b) in enumerate(zip(am, ref.tokens)) if a != b), len(ref.tokens))
    return div == len(ref.tokens), float(kl.mean()), div


# ============================================================================ strategies


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def to_markdown(out: dict, cmd: str) -> str:
    w = out["workload"]
    lines = ["# KV reuse across prompts: kvz chunk store vs kvboost (Gemma 3 270M, CPU)", "",
             f"Command: `{cmd}`", "",
             f"Workload: {w['n_prompts']} prompts, {w['distinct_docs']} distinct documents of {w['doc_tokens']} tokens "
             f"({w['docs_per_prompt']} per prompt, {w['n_topics']} topics), system prompt {w['system_tokens']} tokens, "
             f"mean prompt {w['T_mean']:.0f} tokens; {w['new_tokens']}-token greedy continuations. kvz eps "
             f"{out['config']['eps']}, repair {out['config']['repair']} (R={out['config']['R']}, blend "
             f"{out['config']['blend_ratio']}); torch threads {out['config']['threads']}; total {out['seconds'] / 60:.1f} min.",
             "", "| strategy | TTFT mean s | TTFT median s | speedup (mean) | reuse frac | identical | KL mean | "
                 "stored bytes | raw fp16 bytes | first div |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['strategy']} | {_f(r['ttft_s'], '.3f')} | {_f(r['ttft_median_s'], '.3f')} | "
                     f"{_f(r.get('speedup_mean'), '.2f')} | {_f(r['reuse_frac'], '.3f')} | "
                     f"{_f(r['identical_frac'], '.2f')} | {_f(r['kl_mean'], '.2e')} | "
                     f"{_f(r.get('stored_bytes'), ',d')} | {_f(r.get('raw_fp16_bytes'), ',d')} | "
                     f"{_f(r.get('first_div_mean'), '.1f')} |")
    if out.get("sweep"):
        lines += ["", "## Repair sweep (prompts with content hits)", "",
                  "| repair | R | blend ratio | KL mean | identical | repaired tok | reuse frac | TTFT s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        groups: dict = {}
        for s in out["sweep"]:
            groups.setdefault((s["repair"], s["R"], s["blend_ratio"]), []).append(s)
        for (rep, R, ratio), rs in groups.items():
            lines.append(f"| {rep} | {R} | {ratio} | {np.mean([r['kl_mean'] for r in rs]):.2e} | "
                         f"{np.mean([r['identical'] for r in rs]):.2f} | {np.mean([r['repaired'] for r in rs]):.0f} | "
                         f"{np.mean([r['reuse_frac'] for r in rs]):.3f} | {np.mean([r['ttft_s'] for r in rs]):.3f} |")
    b = out.get("budget")
    if b:
        lines += ["", f"## Byte budget: {b['budget_bytes']:,} bytes ({b['budget_frac']} of {b['distinct_docs']} "
                      f"distinct documents as raw fp16), first {b.get('n_prompts', '?')} prompts", "",
                  "Chunk hit rate: kvz, chunks served / chunks looked up; kvboost, its own cache_manager hit_rate. "
                  "Bytes held: what the store holds at the end (kvz: backend bytes, records included; kvboost: its "
                  "own accounting).", "",
                  "| strategy | TTFT mean s | TTFT median s | speedup (mean) | reuse frac | prompts with reuse | "
                  "chunk hit rate | bytes held | bytes written | evictions |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        t_full = b["rows"][0]["ttft_s"]
        for r in b["rows"]:
            hr = r.get("chunk_hit_rate", r.get("hit_rate"))
            held = r.get("backend_bytes", r.get("stored_bytes"))
            written = r.get("stored_bytes") if "backend_bytes" in r else None
            lines.append(f"| {r['strategy']} | {_f(r['ttft_s'], '.3f')} | {_f(r['ttft_median_s'], '.3f')} | "
                         f"{_f(t_full / r['ttft_s'] if r['ttft_s'] else None, '.2f')} | "
                         f"{_f(r['reuse_frac'], '.3f')} | {_f(r['hit_prompts'], '.2f')} | {_f(hr, '.3f')} | "
                         f"{_f(held, ',d')} | {_f(written, ',d')} | {_f(r.get('evictions'), 'd')} |")
    return "\n".join(lines) + "\n"
