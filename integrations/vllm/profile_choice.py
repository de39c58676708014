"""Profile ``auto``: pick the speed profile a store saves in from what this machine and this store
measure, so that a later hit costs the least time.

At the connector's warm-up (in kvz's load thread, on the cores loads will run on) each profile's
decode throughput is measured on a small synthetic cache of the served model's shape, and the
store's read bandwidth with one probe entry written, read back by ranges and deleted. For a hit of
``V`` values over ``L`` layers, read and decode overlap layer by layer and both overlap the forward:

    read_s   = V * bits_per_value(profile) / 8 / bandwidth
    decode_s = V / decode_throughput(profile)
    load_s   = max(read_s, decode_s) + min(read_s, decode_s) / L
    hit_s    = load_s / L + max(load_s * (L - 1) / L, forward_s)

(the first layer cannot overlap anything; ``forward_s`` is the forward's own time, when known — 0
before the first hit). Bits per value: the store's own saves when it has made some, else the priors
:data:`PRIOR_BPV` (Gemma 3 270M at eps 0.02, measured by the vLLM benchmark) plus the profiles'
measured differences :data:`PROFILE_EXTRA_BPV` (:mod:`alignpred.codec.profiles`). Among the profiles
whose ``hit_s`` is within :data:`TOLERANCE` of the best, the one with the fewest bits wins (the
store holds more). The choice is deterministic given the measurements.

>>> ms = {"default": 30e6, "balanced": 35e6, "fast": 120e6}
>>> choose(ms, bandwidth=2e9, values=8064 * 9216, layers=18, lossless=False)[0]
'fast'
>>> choose(ms, bandwidth=2e9, values=8064 * 9216, layers=18, lossless=False, forward_s=4.0)[0]
'default'
"""
from __future__ import annotations

import time

__all__ = ["PRIOR_BPV", "PROFILE_EXTRA_BPV", "TOLERANCE", "estimate", "choose", "measure_decode", "measure_read"]

PRIOR_BPV = {False: 3.71, True: 9.48}  # lossy eps 0.02 / lossless, bytes per token 4,273 / 10,920 of 9,216 values
PROFILE_EXTRA_BPV = {"default": 0.0, "balanced": 0.05, "fast": 0.79}
TOLERANCE = 0.05


def estimate(throughput: float, bpv: float, bandwidth: float, values: int, layers: int, forward_s: float = 0.0) -> dict:
    """The expected times of one hit (see the module docstring)."""
    read_s = values * bpv / 8 / max(bandwidth, 1.0)
    decode_s = values / max(throughput, 1.0)
    load_s = max(read_s, decode_s) + min(read_s, decode_s) / layers
    hit_s = load_s / layers + max(load_s * (layers - 1) / layers, forward_s)
    return {"read_s": read_s, "decode_s": decode_s, "load_s": load_s, "hit_s": hit_s, "bpv": bpv}


def choose(throughputs: dict, *, bandwidth: float, values: int, layers: int, lossless: bool, forward_s: float = 0.0,
           base_bpv: float | None = None) -> tuple[str, str, dict]:
    """``(profile, reason, estimates per profile)`` for measured decode ``throughputs`` (values/s by
    profile name) and store ``bandwidth`` (bytes/s)."""
    base = PRIOR_BPV[bool(lossless)] if base_bpv is None else float(base_bpv)
    est = {p: estimate(t, base + PROFILE_EXTRA_BPV.get(p, 0.0), bandwidth, values, layers, forward_s)
           for p, t in throughputs.items()}
    best = min(e["hit_s"] for e in est.values())
    ok = [p for p, e in est.items() if e["hit_s"] <= best * (1 + TOLERANCE)]
    pick = min(ok, key=lambda p: (est[p]["bpv"], est[p]["hit_s"]))
    e = est[pick]
    reason = (f"{pick}: expected hit {e['hit_s']:.3f} s for {values} values over {layers} layers "
              f"(read {e['read_s']:.3f} s at {bandwidth / 1e6:.0f} MB/s, decode {e['decode_s']:.3f} s at "
              f"{throughputs[pick] / 1e6:.1f} M values/s, forward {forward_s:.3f} s; "
              + ", ".join(f"{p} {x['hit_s']:.3f} s" for p, x in sorted(est.items())) + ")")
    return pick, reason, est


def _synthetic(shape, tokens: int, dtype: str, seed: int = 0):
    """Correlated synthetic KV (``[(K, V)]`` per layer, numpy) of ``shape`` ``(layers, heads, dim)``:
    smooth along positions and shared across layers, so its bits and decode work resemble a real
    cache's more than white noise does."""
    import numpy as np

    from alignpred.cache import numpy_dtype

    L, H, d = shape
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((H, tokens, d)).cumsum(axis=1) * 0.1 + rng.standard_normal((H, tokens, d))
    dt = numpy_dtype(dtype)
    out = []
    for _ in range(L):
        mk, mv = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(2))
        out.append(((latent @ mk + 0.3 * rng.standard_normal((H, tokens, d))).astype(np.float32).astype(dt),
                    (latent @ mv + 0.3 * rng.standard_normal((H, tokens, d))).astype(np.float32).astype(dt)))
    return out


def measure_decode(store, profiles=("default", "balanced", "fast"), tokens: int = 256, repeats: int = 3) -> dict:
    """Decode throughput (values/s, best of ``repeats``) per profile of ``store``'s mode (eps,
    lossless, bank, threads) on a synthetic cache of its shape."""
    from alignpred import Cache, ErrorBudget, KvzReader, compress_bytes
    from alignpred.codec import profile

    kv = _synthetic(store.shape, tokens, store.dtype)
    meta = {"layer_types": store.layer_types, "keys_roped": True, "rope_theta": store.rope_theta}
    L, H, d = store.shape
    values = 2 * L * H * tokens * d
    out = {}
    for p in profiles:
        blob = compress_bytes(Cache.from_arrays(kv, meta), budget=ErrorBudget(eps=store.eps, lossless=store.lossless),
                              bank=store.bank, profile=profile(p, trust_rope=True), threads=store.threads)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = KvzReader(memoryview(blob), bank=store.bank, session=store.session, threads=store.threads)
            for _ in r.layers():
                pass
            best = min(best, time.perf_counter() - t0)
        out[p] = values / best
    return out


def measure_read(backend, nbytes: int = 4 << 20, key: str = "kvzv:probe:bandwidth") -> float:
    """Bytes/s of a ranged read of a ``nbytes`` probe entry in ``backend`` (written, read in 16
    ranges as a load does, deleted). 0 when the store does not answer."""
    import os

    blob = os.urandom(nbytes)
    try:
        if not backend.put(key, blob):
            return 0.0
        src = backend.open_blob(key)
        if src is None:
            return 0.0
        try:
            step = nbytes // 16
            t0 = time.perf_counter()
            got = sum(len(src.read_range(o, min(step, nbytes - o))) for o in range(0, nbytes, step))
            dt = time.perf_counter() - t0
        finally:
            src.close()
        return got / dt if got == nbytes and dt > 0 else 0.0
    except Exception:  # noqa: BLE001 - a store fault: no bandwidth known
        return 0.0
    finally:
        try:
            backend.delete(key)
        except Exception:  # noqa: BLE001
            pass


def choose_profile(store, backend, shape, tokens: int) -> dict:
    """The ``auto`` choice for a connector: measure ``store``'s decode throughput per profile and
    ``backend``'s ranged-read bandwidth, :func:`choose` for a ``tokens``-token prompt of a model of
    ``shape`` ``(layers, kv_heads, head_dim)``, set ``store.profile`` and return what the
    connector's ``stats()["profile"]`` reports (the choice, its reason and its measurements). A
    measurement that fails chooses ``default`` (the fewest bits) and says why."""
    t0 = time.perf_counter()
    try:
        thr = measure_decode(store)
        bw = measure_read(backend)
        L, H, d = shape
        name, reason, est = choose(thr, bandwidth=bw or 1e9, values=2 * L * H * d * int(tokens), layers=L,
                                   lossless=store.lossless)
        store.profile = name
        return {"profile": name, "setting": "auto", "reason": reason,
                "decode_values_per_s": {k: round(v) for k, v in thr.items()},
                "read_bytes_per_s": round(bw), "tokens": int(tokens),
                "estimates": {k: {x: round(y, 4) for x, y in e.items()} for k, e in est.items()},
                "measure_s": round(time.perf_counter() - t0, 3)}
    except Exception as e:  # noqa: BLE001 - measuring failed: the fewest bits
        store.profile = "default"
        return {"profile": "default", "setting": "auto",
                "reason": f"measurement failed ({type(e).__name__}: {e}); default"}
