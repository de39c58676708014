"""Section 6: restore vs prefill. A long Gemma 3 270M cache is captured (the prefill timed),
compressed, and restored with ``read_into`` preallocated buffers (1 and all threads, interleaved)."""
from __future__ import annotations

import gc
import glob
import inspect
import os
import tempfile
import time

import numpy as np

from ..harness import ROOT, SAMPLES, TEXTS, Op, all_threads, loadavg, run_interleaved, thread_counts, timing
from .config import EPS, SCOPE, log


def long_text() -> tuple[str, list[str]]:
    """Every bundled text (samples/texts/**, calibration texts), concatenated in a fixed order."""
    files = sorted(glob.glob(os.path.join(TEXTS, "**", "*.txt"), recursive=True))
    files += sorted(glob.glob(os.path.join(SAMPLES, "calib_texts", "*.txt")))
    parts = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n\n".join(parts), [os.path.relpath(f, ROOT) for f in files]


def restore_section(tokens: int, bank, *, repeats: int = 3, eps: float = EPS, progress: bool = True,
                    keep: str | None = None) -> dict:
    """Capture a ``tokens``-token Gemma 3 270M cache (timing the prefill), compress it, and time its
    restore (``read_into`` preallocated buffers, 1 and all threads, interleaved)."""
    import torch

    from alignpred import ErrorBudget, KvzReader, compress, load_cache
    from kvz.integrations.hf.gemma import capture, load_gemma, tokenize

    t0 = time.perf_counter()
    model, tok = load_gemma()
    load_s = time.perf_counter() - t0
    text, files = long_text()
    n_text = len(tokenize(tok, text))
    repeats_text = 1
    while n_text * repeats_text < tokens:
        repeats_text += 1
    text = "\n\n".join([text] * repeats_text)
    tmp = tempfile.mkdtemp(prefix="kvz-speed-restore-")
    path = keep or os.path.join(tmp, f"prefill-{tokens}.safetensors")
    capture(text, 64, os.path.join(tmp, "warm.safetensors"), model=model, tokenizer=tok, progress=False)  # warm
    os.remove(os.path.join(tmp, "warm.safetensors"))
    log(f"prefill of {tokens} tokens (torch {torch.get_num_threads()} threads; load {loadavg()}) ...")
    c0 = time.process_time()
    s = capture(text, tokens, path, model=model, tokenizer=tok, progress=progress)
    prefill_cpu = time.process_time() - c0
    prefill = float(s["seconds"])
    log(f"prefill {prefill:.1f} s ({tokens / prefill:.0f} tokens/s)")
    del model
    gc.collect()
    cache = load_cache(path)
    n = cache.layout.n_values
    nth = all_threads()
    c0, t0 = time.process_time(), time.perf_counter()
    info = compress(cache, None, budget=ErrorBudget(eps=eps, scope=SCOPE), bank=bank,
                    **({"threads": nth} if "threads" in inspect.signature(compress).parameters else {}))
    enc_s, enc_cpu = time.perf_counter() - t0, time.process_time() - c0
    data = info.data
    bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
    KvzReader(data, bank=bank).read_into(bufs)  # warm
    ops = [Op("kvz read_into", "restore", th, (lambda t=th: KvzReader(data, bank=bank, threads=t).read_into(bufs)))
           for th in thread_counts()]
    run_interleaved(ops, repeats, label="restore" if progress else "", log=log)
    res = {"tokens": tokens, "model": cache.layout.model, "n_values": n, "raw_bytes": 2 * n,
           "text_files": files, "text_repeats": repeats_text, "text_tokens": n_text, "model_load_s": load_s,
           "prefill_s": prefill, "prefill_cpu_s": prefill_cpu, "prefill_chunk": s.get("chunk"),
           "torch_threads": torch.get_num_threads(), "prefill_tokens_per_s": tokens / prefill,
           "file_bytes": len(data), "bpv": 8.0 * len(data) / n, "encode_s": enc_s, "encode_cpu_s": enc_cpu,
           "encode_threads": nth, "restore": {}}
    for o in ops:
        t = timing(o.walls, o.cpus)
        t["vps"] = n / t["wall_s"]
        t["fraction_of_prefill"] = t["wall_s"] / prefill
        t["fraction_of_prefill_cpu"] = t["cpu_s"] / prefill_cpu
        res["restore"][str(o.threads)] = t
    if not keep:
        os.remove(path)
    os.rmdir(tmp) if not os.listdir(tmp) else None
    return res
