"""kvz inside LMCache and SGLang HiCache: the break-even table (``python -m kvz.benchmarks.engines``).

On real Gemma 3 270M chunks (``samples/gemma3-270m``: 3 caches x 448 tokens; 256-token chunks at
positions 0 and 192, LMCache's ``[2, L, T, H*D]`` serde layout) it measures, on one thread:

* LMCache's own serdes through their real classes: ``fp8`` (``Fp8QuantizationSerializer``) round
  trip, bytes, time; ``turboquant`` needs CUDA (Triton kernels), so only its exact serialized size
  is reported (LMCache's ``estimate_serialized_size``; no error or time on a CPU);
* raw bf16; kvz (the ``"kvz"`` serde's classes) at **matched error** (eps = fp8's worst tensor
  NRMSE on that chunk), at **matched predicted KL** (``target_kl`` = fp8's predicted next-token
  KL under the bank's sensitivity weights — predicted, not measured with the model), and lossless;
* kvz with the rotary phase searched (position-blind caller) against the true offset: the bpv
  difference is the cost of not knowing the position;
* the link speed below which each method beats shipping raw bf16: ``(raw - bytes) * 8 / decode_s``
  for loading (and with ``encode_s`` for storing);
* with ``--engines sglang`` (in a venv with SGLang): the HiCache backend's page round trip through
  SGLang's ``MHATokenToKVPoolHost`` in every layout.

``--json OUT`` writes rows with at least ``engine, path, roundtrip, worst_nrmse, bpv``; ``--md OUT``
the table. ``--append`` keeps rows of other engines already in ``OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from alignpred import nrmse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
NAMES = ("english-prose", "german-prose", "python-code")
BANK = "gemma-3-270m"
T = 256
STARTS = (0, 192)


def _worst(ref, got) -> float:
    """Worst per-tensor (layer, K/V) NRMSE of [2, L, T, HD] torch tensors."""
    r, g = ref.float().numpy(), got.float().numpy()
    return max(nrmse(r[j, i], g[j, i]) for j in range(2) for i in range(r.shape[1]))


def _tensor_nrmses(ref, got) -> dict:
    r, g = ref.float().numpy(), got.float().numpy()
    return {f"layers.{i}.{'key' if j == 0 else 'value'}": nrmse(r[j, i], g[j, i])
            for j in range(2) for i in range(r.shape[1])}


def load_chunks():
    """[(name, start, tensor [2, L, T, HD] bf16)] and the model metadata."""
    import torch

    from alignpred import load_cache
    from kvz.integrations.lmcache import model_metadata

    out, meta = [], None
    for n in NAMES:
        c = load_cache(os.path.join(SAMPLES, n + ".safetensors"))
        meta = model_metadata(c.metadata)
        L = c.layout.num_layers
        for s in STARTS:
            a = np.stack([np.stack([np.asarray(c.tensors[f"layers.{i}.{kv}"])[:, s:s + T].view(np.uint16)
                                    .transpose(1, 0, 2).reshape(T, -1) for i in range(L)]) for kv in ("key", "value")])
            out.append((n, s, torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16)))
    return out, meta


def _obj(alloc, shape, dtype):
    import torch

    return alloc.allocate([torch.Size(shape)], [dtype])


CPU_TIMES: dict = {}


def _timed(fn, reps: int, tag=None):
    """(result, median wall seconds); the median CPU seconds of the process go to CPU_TIMES[tag]."""
    ts, cs = [], []
    r = None
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    if tag is not None:
        CPU_TIMES[tag] = statistics.median(cs)
    return r, statistics.median(ts)


def run_serde(ser, de, x, alloc, reps=1):
    """Serialize/deserialize one chunk through LMCache serde classes; (bytes, decoded, enc_s, dec_s)."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    key = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1), model_name="gemma-3-270m", kv_rank=0)
    src = _obj(alloc, x.shape, x.dtype)
    src.tensor.copy_(x)
    cap = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[x.shape], dtypes=[x.dtype]))
    dst = _obj(alloc, (cap,), torch.uint8)
    n, enc = _timed(lambda: ser.serialize(src, dst, key), reps, "enc")
    back = _obj(alloc, x.shape, x.dtype)
    _, dec = _timed(lambda: de.deserialize(dst, back, key), reps, "dec")
    return int(n), back.tensor.clone(), enc, dec


def lmcache_rows(reps: int, quick: bool):
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import (
        Fp8QuantizationDeserializer,
        Fp8QuantizationSerializer,
        TurboQuantSerdeConfig,
        TurboQuantSerializer,
    )
    from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator

    from kvz.integrations.lmcache import KvzChunkCodec, KvzDeserializer, KvzSerializer

    chunks, meta = load_chunks()
    if quick:
        chunks = chunks[:2]
    alloc = AdHocMemoryAllocator(device="cpu")
    weights = _sensitivity()
    rows = []
    # warm-up (numba compilation, plan set-up, torch kernels) so that the timings below are steady state
    _, _, w = chunks[0]
    for kw in ({"eps": 0.0267}, {"eps": 0.0267, "lossless": True}):
        o = {"bank": BANK, "metadata": meta, "chunk_size": 64, **kw}
        run_serde(KvzSerializer(o), KvzDeserializer(o), w, alloc, 1)
    run_serde(Fp8QuantizationSerializer(), Fp8QuantizationDeserializer(), w, alloc, 1)
    if weights:
        _kvz_target_kl(w, meta, 1e-3, 0)
    for name, start, x in chunks:
        nval = x.numel()
        raw = nval * 2
        base = {"engine": "lmcache", "path": "serde", "chunk": f"{name}@{start}", "tokens": T, "values": nval}

        def row(method, nbytes, worst, enc, dec, roundtrip, **kw):
            r = dict(base, method=method, bytes=nbytes, bpv=8.0 * nbytes / nval, worst_nrmse=worst,
                     encode_s=enc, decode_s=dec, roundtrip=roundtrip,
                     encode_cpu_s=CPU_TIMES.get("enc") if enc else None,
                     decode_cpu_s=CPU_TIMES.get("dec") if dec else None)
            r["breakeven_load_gbps_cpu"] = ((raw - nbytes) * 8 / r["decode_cpu_s"] / 1e9) \
                if r["decode_cpu_s"] and nbytes < raw else None
            r["breakeven_load_gbps"] = ((raw - nbytes) * 8 / dec / 1e9) if dec and nbytes < raw else None
            r["breakeven_store_gbps"] = ((raw - nbytes) * 8 / enc / 1e9) if enc and nbytes < raw else None
            r.update(kw)
            rows.append(r)
            return r

        row("raw-bf16", raw, 0.0, 0.0, 0.0, True)
        n, y, enc, dec = run_serde(Fp8QuantizationSerializer(), Fp8QuantizationDeserializer(), x, alloc, reps)
        fp8_worst = _worst(x, y)
        fp8_kl = _pred_kl(weights, _tensor_nrmses(x, y))
        row("lmcache-fp8", n, fp8_worst, enc, dec, True, predicted_kl=fp8_kl)
        for preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"):
            cfg = TurboQuantSerdeConfig(preset=preset, head_dim=256, block_size=16)
            nb = TurboQuantSerializer(cfg).estimate_serialized_size(
                MemoryLayoutDesc(shapes=[x.shape], dtypes=[x.dtype]))
            row(f"lmcache-{preset}", nb, None, None, None, False,
                note="needs CUDA (Triton kernels): size from LMCache's estimate_serialized_size, no error/time on CPU")
        opts = {"bank": BANK, "metadata": meta, "chunk_size": 64}
        # kvz at matched error, position searched (LMCache's serde key has no position)
        kz = dict(opts, eps=fp8_worst)
        n, y, enc, dec = run_serde(KvzSerializer(kz), KvzDeserializer(kz), x, alloc, reps)
        r = row("kvz-matched-error", n, _worst(x, y), enc, dec, True, eps=fp8_worst,
                predicted_kl=_pred_kl(weights, _tensor_nrmses(x, y)))
        # the same with the true position given (what a position-aware caller gets)
        codec = KvzChunkCodec(bank=BANK, eps=fp8_worst, cache_metadata=meta)
        from kvz.integrations.lmcache import kv_pairs

        pairs = kv_pairs(x, 1)
        blob_true = codec.encode(pairs, start)
        blob_zero = codec.encode(pairs, 0)
        r["bpv_true_position"] = 8.0 * (len(blob_true) + 16) / nval
        r["bpv_position_zero"] = 8.0 * (len(blob_zero) + 16) / nval
        t0 = time.perf_counter()
        found = codec.find_offset(codec.tensors(pairs), step=64)
        r["search_s"] = time.perf_counter() - t0
        r["found_position"] = found
        r["true_position"] = start
        # kvz at matched predicted KL (weighted scope, target_kl = fp8's predicted KL)
        if fp8_kl is not None:
            kk = _kvz_target_kl(x, meta, fp8_kl, start)
            row("kvz-matched-pkl", kk["bytes"], kk["worst"], kk["enc"], kk["dec"], True, predicted_kl=kk["pkl"],
                target_kl=fp8_kl, note="position given; KL predicted from the bank's sensitivity weights")
        kl = dict(opts, eps=0.0267, lossless=True)
        n, y, enc, dec = run_serde(KvzSerializer(kl), KvzDeserializer(kl), x, alloc, reps)
        row("kvz-lossless", n, _worst(x, y), enc, dec, bool(torch.equal(x.view(torch.int16), y.view(torch.int16))),
            bit_exact=bool(torch.equal(x.view(torch.int16), y.view(torch.int16))))
    return rows


def _sensitivity():
    try:
        from alignpred.bank import find, sensitivity

        b = find(BANK)
        rec = sensitivity(b.id, b.model)
        return rec.get("tensor_weights") if rec else None
    except Exception:
        return None


def _pred_kl(weights, nrmses: dict):
    if not weights:
        return None
    return float(sum(float(weights.get(k, 0.0)) * v * v for k, v in nrmses.items()))


def _kvz_target_kl(x, meta, target_kl, start):
    import torch

    from alignpred import Cache, ErrorBudget, KvzReader, compress
    from kvz.integrations.lmcache import KvzChunkCodec, kv_pairs

    pairs = kv_pairs(x, 1)
    tensors = KvzChunkCodec(bank=BANK, cache_metadata=meta).tensors(pairs)
    cache = Cache.from_arrays(tensors, dict(meta, position_offset=start))
    info, enc = _timed(lambda: compress(cache, None, bank=BANK, budget=ErrorBudget(target_kl=target_kl), threads=1), 1, "enc")
    back, dec = _timed(lambda: KvzReader(info.data, threads=1).read(), 3, "dec")
    L = len(pairs)
    y = torch.zeros_like(x)
    from kvz.integrations.lmcache import write_pairs

    write_pairs(y, [(back[f"layers.{i}.key"], back[f"layers.{i}.value"]) for i in range(L)])
    return {"bytes": len(info.data) + 16, "worst": _worst(x, y), "enc": enc, "dec": dec,
            "pkl": float(info.kl_predicted) if info.kl_predicted is not None else None}


def sglang_rows(reps: int):
    """Page round trips through SGLang's host pool and the kvz HiCache backend (directory store)."""
    import tempfile

    import torch

    from kvz.integrations.sglang import (
        cpu_host_pool,
        hicache_extra,
        install_torchvision_stub,
        page_to_pairs,
        storage_config,
    )

    install_torchvision_stub()  # before SGLang's import: PyPI's torchvision needs CUDA
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    P = 64
    chunks, _ = load_chunks()
    rows = []
    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        for lossless in (False, True):
            pool = cpu_host_pool(layout)
            with tempfile.TemporaryDirectory() as d:
                extra = hicache_extra(d, os.path.join(SAMPLES, NAMES[0] + ".safetensors"),  # the rows' eps 0.0267
                                      eps=None if lossless else 0.0267, kvz_lossless=lossless)
                be = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
                be.register_mem_pool_host(pool)
                name, start, x = chunks[0]  # [2, L, 256, HD]: four 64-token pages at positions 0..192
                c = x.reshape(2, x.shape[1], T, 1, -1)
                flat = []
                for i in range(T // P):
                    cc = c[:, :, i * P:(i + 1) * P]
                    f = {"layer_first": cc.flatten(), "page_first": cc.permute(0, 2, 1, 3, 4).flatten(),
                         "page_first_direct": cc.unsqueeze(1).flatten(),
                         "page_head": cc.permute(0, 3, 2, 1, 4).unsqueeze(1).flatten()}[layout]
                    flat.append(f)
                    pool.set_from_flat_data_page(P * (1 + i), f)
                keys = [f"{name}-{i}" for i in range(T // P)]
                t0 = time.perf_counter()
                ok = be.batch_set_v1(keys, torch.arange(P, P * (1 + T // P)), HiCacheStorageExtraInfo(prefix_keys=[]))
                enc = time.perf_counter() - t0
                nbytes = sum(len(be.backend.get(be._key(k))) for k in keys)
                t0 = time.perf_counter()
                got = be.batch_get_v1(keys, torch.arange(P * 8, P * (8 + T // P)), HiCacheStorageExtraInfo(prefix_keys=[]))
                dec = time.perf_counter() - t0
                worst, exact = 0.0, True
                for i in range(T // P):
                    have = pool.get_data_page(P * (8 + i))
                    exact &= bool(torch.equal(have.view(torch.int16), flat[i].view(torch.int16)))
                    for (kw, vw), (kh, vh) in zip(page_to_pairs(flat[i], layout, 18, P, 1, 256),
                                                  page_to_pairs(have, layout, 18, P, 1, 256)):
                        worst = max(worst, nrmse(kw.astype(np.float32), kh.astype(np.float32)),
                                    nrmse(vw.astype(np.float32), vh.astype(np.float32)))
                nval = x.numel()
                rows.append({"engine": "sglang", "path": f"hicache-v1/{layout}", "method": "kvz-lossless" if lossless
                             else "kvz-eps0.0267", "chunk": f"{name}@0", "tokens": T, "values": nval, "bytes": nbytes,
                             "bpv": 8.0 * nbytes / nval, "worst_nrmse": worst,
                             "roundtrip": bool(all(ok) and all(got) and (exact if lossless else worst <= 0.0267)),
                             "bit_exact": exact, "encode_s": enc, "decode_s": dec, "page_size": P})
    return rows


def markdown(rows) -> str:
    out = ["# kvz inside LMCache and SGLang: break-even table", "",
           "Command: `python -m kvz.benchmarks.engines --json benchmarks/results/engines.json "
           "--md benchmarks/results/engines.md` (LMCache venv) and `... --engines sglang --append` (SGLang venv); "
           "one thread, real Gemma 3 270M chunks (256 tokens x 18 layers x 1 KV head x 256, bf16) of the three "
           "bundled samples at positions 0 and 192. Break-even: the link speed below which loading "
           "(`(raw - bytes) * 8 / decode_s`) or storing (`... / encode_s`) the method beats raw bf16; wall times "
           "depend on the machine's load (CPU times of the process in parentheses, and the load average in the "
           "JSON).", ""]
    lm = [r for r in rows if r["engine"] == "lmcache"]
    if lm:
        out += ["## LMCache L2 serde (means over chunks)", "",
                "| method | bpv | worst tensor NRMSE (max) | predicted KL | encode ms (CPU ms) | decode ms (CPU ms) | "
                "pays below (load, wall / CPU) Gbit/s | pays below (store) Gbit/s | round trip |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in dict.fromkeys(r["method"] for r in lm):
            rs = [r for r in lm if r["method"] == m]

            def mean(k, rs=rs):
                v = [r[k] for r in rs if r.get(k) is not None]
                return statistics.mean(v) if v else None

            def f(v, fmt):
                return "n/a" if v is None else format(v, fmt)

            worst = [r["worst_nrmse"] for r in rs if r.get("worst_nrmse") is not None]
            out.append(f"| {m} | {mean('bpv'):.3f} | {f(max(worst) if worst else None, '.4f')} | "
                       f"{f(mean('predicted_kl'), '.2e')} | {f(mean('encode_s') and mean('encode_s') * 1e3, '.0f')} "
                       f"({f(mean('encode_cpu_s') and mean('encode_cpu_s') * 1e3, '.0f')}) | "
                       f"{f(mean('decode_s') and mean('decode_s') * 1e3, '.0f')} "
                       f"({f(mean('decode_cpu_s') and mean('decode_cpu_s') * 1e3, '.0f')}) | "
                       f"{f(mean('breakeven_load_gbps'), '.2f')} / {f(mean('breakeven_load_gbps_cpu'), '.2f')} | "
                       f"{f(mean('breakeven_store_gbps'), '.2f')} | {all(r['roundtrip'] for r in rs)} |")
        me = [r for r in lm if r["method"] == "kvz-matched-error"]
        if me:
            d = [r["bpv"] - (r["bpv_true_position"]) for r in me]
            z = [r["bpv_position_zero"] - r["bpv_true_position"] for r in me]
            hits = sum(r["found_position"] == r["true_position"] for r in me)
            out += ["", "## Position-blind callers (LMCache's serde and storage keys carry no position)", "",
                    f"Rotary phase searched over 64-token-aligned offsets below 8,192 by the bank-frame score "
                    f"(`kvz.integrations.lmcache.position.find_position_offset`): found the true offset in "
                    f"{hits}/{len(me)} chunks; bpv with the found offset minus bpv with the true one: "
                    f"mean {statistics.mean(d):+.4f}, max {max(d):+.4f} (target <= 0.02); coding at offset 0 instead "
                    f"would cost {statistics.mean(z):+.3f} bpv on average. Search time: "
                    f"{statistics.mean(r['search_s'] for r in me) * 1e3:.0f} ms per chunk.", ""]
            out += ["| chunk | true | found | bpv found | bpv true | bpv at 0 |", "| --- | --- | --- | --- | --- | --- |"]
            for r in me:
                out.append(f"| {r['chunk']} | {r['true_position']} | {r['found_position']} | {r['bpv']:.3f} | "
                           f"{r['bpv_true_position']:.3f} | {r['bpv_position_zero']:.3f} |")
        tq = [r for r in lm if r["method"].startswith("lmcache-turboquant")]
        if tq:
            out += ["", "TurboQuant rows: LMCache 0.5.6's turboquant serde runs Triton kernels on CUDA only; on this "
                    "CPU only its exact serialized size (`estimate_serialized_size`, two raw layers at each end by "
                    "default) is measured, not its error or speed."]
    sg = [r for r in rows if r["engine"] == "sglang"]
    if sg:
        out += ["", "## SGLang HiCache backend (v1 path, SGLang's MHATokenToKVPoolHost, 64-token pages, directory store)",
                "", "| layout | method | bpv | worst tensor NRMSE | bit-exact | set 4 pages ms | get 4 pages ms | round trip |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sg:
            out.append(f"| {r['path'].split('/')[1]} | {r['method']} | {r['bpv']:.3f} | {r['worst_nrmse']:.4f} | "
                       f"{r['bit_exact']} | {r['encode_s'] * 1e3:.0f} | {r['decode_s'] * 1e3:.0f} | {r['roundtrip']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvz.benchmarks.engines", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="lmcache", help="comma list: lmcache, sglang")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--md", dest="md_out")
    ap.add_argument("--append", action="store_true", help="keep other engines' rows already in --json")
    ap.add_argument("--reps", type=int, default=3, help="timing repetitions (median)")
    ap.add_argument("--quick", action="store_true", help="two chunks only")
    a = ap.parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except Exception:
        pass
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    rows = []
    try:
        if "lmcache" in engines:
            rows += lmcache_rows(a.reps, a.quick)
        if "sglang" in engines:
            rows += sglang_rows(a.reps)
    except ImportError as e:
        print(f"Error: {e} (run in a venv with the engine installed: .ci/lmcache.sh / .ci/sglang.sh)", file=sys.stderr)
        return 2
    if a.json_out:
        keep = []
        if a.append and os.path.exists(a.json_out):
            with open(a.json_out) as f:
                keep = [r for r in json.load(f)["rows"] if r["engine"] not in engines]
        rows = keep + rows
        with open(a.json_out, "w") as f:
            json.dump({"command": "python -m kvz.benchmarks.engines " + " ".join(argv or sys.argv[1:]),
                       "load_average": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows},
                      f, indent=1)
    md = markdown(rows)
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
