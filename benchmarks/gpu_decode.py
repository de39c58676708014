"""GPU decode (alignpred.gpu, issue 40): G values/s, device memory and time per hit against a raw
host-to-device copy of the bf16 cache; on a machine without CUDA, the same kernels in Triton's
interpreter on a small cache, checked bit for bit against the CPU decoder.

The cache is a bundled Gemma 3 270M sample (448 tokens, bf16) tiled along the tokens to
``--tokens`` (default 8,192 on CUDA, 64 in the simulator; tiling keeps real values, so the entropy
stage and the maps see real statistics, though the repeated RoPE positions make the keys code
worse than a real 8K cache), compressed in the ``balanced`` profile (lanes32, linear maps; the GPU
decoder needs exact arithmetic) at ``--eps`` with the bundled bank. On CUDA: ``--repeats`` timed
decodes (after one warm-up) into a plain ``[layers, 2, T, 1, 256]`` tensor and into vLLM's flash
layout, ``torch.cuda.max_memory_allocated`` over a decode, and the copy of the raw bf16 cache from
pinned host memory. Either way the device decode is compared with the CPU decoder's bits.

    python -m kvz.benchmarks.gpu_decode [--json OUT] [--tokens N] [--eps E] [--repeats R]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

from kvz.benchmarks.harness import code_revision, loadavg, machine_info, parser, resolve_bank, sample_caches


def tiled_cache(path: str, tokens: int):
    """The sample at ``path`` repeated along its tokens to ``tokens`` positions."""
    from alignpred import load_cache
    from alignpred.cache import Cache, infer_layout

    c = load_cache(path)
    t = {}
    for name, a in c.tensors.items():
        a = np.asarray(a)
        reps = -(-tokens // a.shape[-2])
        t[name] = np.ascontiguousarray(np.concatenate([a] * reps, axis=-2)[..., :tokens, :])
    meta = {k: v for k, v in c.metadata.items() if k != "token_ids"}
    return Cache(t, meta, infer_layout(t, meta))


def cpu_bits(r) -> np.ndarray:
    out = r.read(tier="coarse")
    lay = r.layout
    res = np.stack([np.stack([np.ascontiguousarray((out[f"layers.{i}.{k}"][0] if out[f"layers.{i}.{k}"].ndim == 4
                                                     else out[f"layers.{i}.{k}"]).transpose(1, 0, 2))
                              for k in ("key", "value")]) for i in range(lay.num_layers)])
    return res.view(np.int16 if res.itemsize == 2 else np.int32)


def dev_bits(t) -> np.ndarray:
    import torch

    t = t.cpu()
    return (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy()


def main(argv=None) -> int:
    ap = parser(__doc__, json="write the results as JSON here")
    ap.add_argument("--tokens", type=int, default=None, help="cache length (default 8192 on CUDA, 64 simulated)")
    ap.add_argument("--eps", type=float, default=0.0267, help="error budget (tensor NRMSE; default 0.0267)")
    ap.add_argument("--repeats", type=int, default=5, help="timed decodes on CUDA (default 5)")
    args = ap.parse_args(argv)
    import torch

    import alignpred.gpu as GD
    from alignpred import KvzReader, compress
    from alignpred.codec import profile

    sim = GD.simulated()
    T = args.tokens or (64 if sim else 8192)
    if T < 1 or args.repeats < 1:
        ap.error("--tokens and --repeats must be at least 1")
    sample = sample_caches()[0]
    bank = resolve_bank()
    cache = tiled_cache(sample, T)
    res: dict = {"simulated": sim, "device": "triton interpreter (CPU)" if sim else torch.cuda.get_device_name(),
                 "tokens": T, "sample": os.path.basename(sample), "eps": args.eps, "profile": "balanced",
                 "code": code_revision(), "machine": machine_info(), "loadavg": loadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "hit.kvz")
        t0 = time.perf_counter()
        compress(cache, p, budget=args.eps, bank=bank, profile=profile("balanced", trust_rope=True))
        res["compress_s"] = time.perf_counter() - t0
        r = KvzReader(p, bank=bank, threads=1)
        lay = r.layout
        n_values = 2 * lay.num_layers * lay.n_tokens * lay.kv_heads * lay.head_dim
        res.update(values=n_values, file_bytes=os.path.getsize(p), bpv=os.path.getsize(p) * 8 / n_values)
        t0 = time.perf_counter()
        want = cpu_bits(r)
        res["cpu_decode_s"] = time.perf_counter() - t0
        if sim:
            t0 = time.perf_counter()
            got = GD.decode(r)
            res["sim_decode_s"] = time.perf_counter() - t0
            res["bit_identical"] = bool(np.array_equal(dev_bits(got), want))
        else:
            out = GD.decode(r)          # warm-up: kernels compile, weights and tables uploaded
            torch.cuda.synchronize()
            res["bit_identical"] = bool(np.array_equal(dev_bits(out), want))
            times = []
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                GD.decode(r)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res["decode_s"] = sorted(times)[len(times) // 2]
            res["g_values_per_s"] = n_values / res["decode_s"] / 1e9
            res["peak_memory_bytes"] = torch.cuda.max_memory_allocated() - base_mem
            bs = 16
            nblk = -(-T // bs)
            kv = [torch.zeros((2, nblk, bs, lay.kv_heads, lay.head_dim), dtype=torch.bfloat16, device="cuda")
                  for _ in range(lay.num_layers)]
            table = np.arange(nblk)
            GD.decode_paged(r, kv, table)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            GD.decode_paged(r, kv, table)
            torch.cuda.synchronize()
            res["decode_paged_flash_s"] = time.perf_counter() - t0
            raw = torch.empty(n_values, dtype=torch.bfloat16).pin_memory()
            dst = torch.empty(n_values, dtype=torch.bfloat16, device="cuda")
            dst.copy_(raw, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                dst.copy_(raw, non_blocking=True)
            torch.cuda.synchronize()
            res["raw_h2d_s"] = (time.perf_counter() - t0) / args.repeats
            res["raw_h2d_gb_per_s"] = 2 * n_values / res["raw_h2d_s"] / 1e9
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
