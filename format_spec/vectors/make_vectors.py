"""Regenerate the .kvz golden vectors of format 1.1 (deterministic; run from anywhere)::

    python format_spec/vectors/make_vectors.py

The vectors of format 1.0 (written by kvz 0.1: float arithmetic) are frozen: they are kept as
they are, with their manifest entries, and every later version must still decode them; this
script only (re)makes the 1.1 vectors (exact arithmetic: their decode is bit-exact everywhere).

For each vector ``NAME`` it writes, next to this script:

* ``NAME.input.safetensors`` — the cache that was compressed;
* ``NAME.kvz``               — the compressed file;
* ``NAME.bank.h5``           — the bank, unless it is embedded in the .kvz;
* ``NAME.expected.npz``      — the expected decode (no pickle): ``dec.<tensor>`` holds the
  decoded tensor's raw bits (uint16 for bf16/f16, uint32 for f32; dtype in the manifest) and
  ``q.<tensor index>.<object index>`` the object's decoded symbols, int32 ``[C, n]``
  (C = kv_heads * head_dim channels, n tokens) — these are bit-exact by the spec; for lossless
  (two-tier) vectors also ``coarse.<tensor>`` (the coarse tier's decode) and ``r.<ti>.<j>``
  (the refinement symbols);

and ``manifest.json`` with the parameters, sha256 of every file, the parse facts a reader must
find, the comparison tolerance and the platform the files were made on. ``tests/test_golden.py``
and ``tests/test_spec_reader.py`` check them.

The real-data vector slices ``samples/gemma3-270m/english-prose.safetensors`` (layers 0-2, the
first 300 tokens); it is skipped (and the old files kept) when that sample is absent.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from alignpred import Bank, CodecConfig, ErrorBudget, KvzReader, compress, fit_bank, load_cache, save_cache  # noqa: E402
from alignpred.codec import Profile  # noqa: E402
from alignpred import entropy  # noqa: E402

REAL_SAMPLE = os.path.join(ROOT, "samples", "gemma3-270m", "english-prose.safetensors")
# Decoded values may differ across machines in the last float32 ulps (BLAS); per element
# |got - want| <= ULPS * spacing(dtype, |want|) + REL_RMS * rms(want tensor).  See kvz.md §9.
TOLERANCE = {"ulps": 1, "rel_rms": 1e-4}


def _synthetic(n_layers, heads, T, d, dtype, seed, meta_extra=None, zero=None, batch=False, neg_zero=None):
    """Correlated synthetic cache (layers share a latent signal), keys marked RoPE'd."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((heads, T, d)).cumsum(axis=1) * 0.1 + rng.standard_normal((heads, T, d))
    t = {}
    for i in range(n_layers):
        mk = rng.standard_normal((d, d)) / np.sqrt(d)
        mv = rng.standard_normal((d, d)) / np.sqrt(d)
        t[f"layers.{i}.key"] = latent @ mk + 0.3 * rng.standard_normal((heads, T, d)) + 0.5
        t[f"layers.{i}.value"] = latent @ mv + 0.3 * rng.standard_normal((heads, T, d))
    if zero:
        name, a, b = zero
        t[name][:, a:b] = 0.0
    out = {}
    for k, v in t.items():
        v = v.astype(np.float32).astype(dtype)
        if neg_zero and k == neg_zero[0]:  # signed zeros must come back as they were
            v[:, neg_zero[1]:neg_zero[2], ::3] = -np.zeros((), dtype)
        out[k] = v[None] if batch else v
    meta = {"model": "synthetic", "keys_roped": "true", "rope_theta": json.dumps([1e4] * n_layers),
            "rope_pairing": "half", "position_offset": "0",
            "layer_types": json.dumps(["sliding_attention"] * n_layers)}
    meta.update(meta_extra or {})
    return out, meta


def _real():
    c = load_cache(REAL_SAMPLE)
    t = {f"layers.{i}.{k}": np.ascontiguousarray(c.tensors[f"layers.{i}.{k}"][..., :300, :])
         for i in range(3) for k in ("key", "value")}
    meta = dict(c.metadata)
    for key in ("layer_types", "rope_theta"):
        meta[key] = json.dumps(json.loads(meta[key])[:3])
    if "token_ids" in meta:
        meta["token_ids"] = json.dumps(json.loads(meta["token_ids"])[:300])
    meta["source"] = "english-prose.safetensors, layers 0-2, tokens 0-299"
    return t, meta


FROZEN = ("synth-tensor-extbank", "synth-object-embedded-align", "synth-pooled-f32-batch", "synth-constriction-coder",
          "gemma3-270m-3l-300t")  # format 1.0 vectors made by kvz 0.1; never regenerated


def _rope_meta(n_layers, d):
    """A format-1.1 RoPE spec: interleaved pairs, partial rotary (d - 4 channels), YaRN-like
    attention scaling, one table on sliding layers and another on the last layer."""
    from alignpred.cache.rope import RopeSpec, RopeTable

    a = RopeTable.from_theta(1e4, d, rotary_dim=d - 4, pairing="interleaved", attention_scaling=1.25)
    b = RopeTable.from_theta(1e6, d, rotary_dim=d - 4, pairing="interleaved", attention_scaling=1.25)
    spec = RopeSpec((a, b), tuple([0] * (n_layers - 2) + [-1, 1]))  # one layer without RoPE
    return {"rope": json.dumps(spec.to_json()), "keys_roped": "true"}


def _real_v11():
    t, meta = _real()
    meta = dict(meta, source="english-prose.safetensors, layers 0-2, tokens 0-299 (format 1.1 vector)")
    return t, meta


def _real_v12():
    t, meta = _real()
    meta = dict(meta, source="english-prose.safetensors, layers 0-2, tokens 0-299 (format 1.2 vector)")
    return t, meta


def vectors():
    """The format-1.1 and 1.2 vectors (regenerated by :func:`main`; the 1.0 ones are frozen)."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16

    def no_theta(t_meta):
        t, meta = t_meta
        meta = {k: v for k, v in meta.items() if k not in ("rope_theta", "rope_pairing")}
        return t, meta

    return [
        ("v11-synth-tensor-extbank",
         lambda: _synthetic(2, 2, 300, 16, np.float16, 11),
         dict(eps=0.05, scope="tensor", config=CodecConfig(), embed_bank=False),
         dict(rank=4, rotations=False)),
        ("v11-synth-lossless-bf16-rope",
         lambda: no_theta(_synthetic(3, 1, 300, 16, bf16, 12,
                                     dict(_rope_meta(3, 16), position_offset="5",
                                          layer_types=json.dumps(["sliding_attention"] * 2 + ["full_attention"])),
                                     zero=("layers.1.value", 256, 300), neg_zero=("layers.2.key", 10, 14))),
         dict(eps=0.08, scope="object", config=CodecConfig(blend=True), embed_bank=True, lossless=True),
         dict(rank=None, rotations=False)),
        ("v11-synth-weighted-f32-batch",
         lambda: _synthetic(2, 1, 100, 8, np.float32, 13, batch=True),
         dict(eps=0.02, scope="weighted", config=CodecConfig(object_size=32), embed_bank=True, tensor_cap=2.0,
              weights={"layers.0.key": 4.0, "layers.0.value": 1.0, "layers.1.key": 2.0, "layers.1.value": 0.5}),
         dict(rank=2, rotations=False)),
        ("v11-gemma3-270m-3l-300t",
         _real_v11,
         dict(eps=0.03, scope="tensor", config=CodecConfig(), embed_bank=True),
         dict(rank=8, rotations=False)),
        # format 1.2: the lanes32 coder (kvz.md section 7.3)
        ("v12-synth-lanes32-lossless",
         lambda: no_theta(_synthetic(2, 2, 300, 16, bf16, 21, dict(_rope_meta(2, 16), position_offset="3"),
                                     zero=("layers.1.value", 256, 300))),
         dict(eps=0.05, scope="tensor", config=CodecConfig(), embed_bank=True, lossless=True, coder="lanes32"),
         dict(rank=4, rotations=False)),
        ("v12-gemma3-270m-3l-300t-lanes32",
         _real_v12,
         dict(eps=0.03, scope="tensor", config=CodecConfig(), embed_bank=True, coder="lanes32"),
         dict(rank=8, rotations=False)),
        # format 1.3: per-channel steps, stale rows of sliding layers, the attention scope (kvz.md 8.5, 8.8)
        ("v13-synth-attention-stale",
         lambda: _synthetic(3, 1, 600, 16, np.float16, 31, dict(token_ids=json.dumps(list(range(600))))),
         dict(eps=0.03, scope="attention", config=CodecConfig(), embed_bank=True, tensor_cap=3.0,
              weights={"layers.0.key": 3.0, "layers.0.value": 1.0, "layers.1.key": 2.0, "layers.1.value": 0.5,
                       "layers.2.key": 4.0, "layers.2.value": 1.5},
              attention_stats=lambda bank: _attention_stats(bank, 3, 16, window=64),
              capture_stats=_capture_stats),
         dict(rank=8, rotations=False)),
    ]


def _capture_stats(cache):
    """Uneven per-position attention of a synthetic vector's prefill (row steps, kvz.md 8.5)."""
    from alignpred.bank import CaptureStats, tokens_digest

    lay = cache.layout
    L, H, T, d = lay.num_layers, lay.kv_heads, lay.n_tokens, lay.head_dim
    rng = np.random.default_rng(8)
    mass = rng.lognormal(0.0, 1.2, (L, H, T))
    mass /= mass.sum(-1, keepdims=True)
    sq = mass ** 2 * rng.lognormal(0.0, 0.3, (L, H, T))
    return CaptureStats(model=lay.model, n_tokens=T, tokens_sha256=tokens_digest(range(T)),
                        layer_types=tuple(lay.layer_types), pairing="half", q_channel=np.ones((L, H, d)), mass=mass,
                        sq=sq, value_gram=np.broadcast_to(np.eye(d), (L, H, d, d)))


def _attention_stats(bank, n_layers, d, window):
    """Uneven attention statistics for a synthetic vector (pair-constant key weights)."""
    from dataclasses import replace

    from alignpred.bank import AttentionStats

    rng = np.random.default_rng(7)
    s = AttentionStats.empty("synthetic", bank.id, ["sliding_attention"] * n_layers, kv_heads=1, head_dim=d)
    half = rng.lognormal(0.0, 1.5, (n_layers, 1, d // 2))
    return replace(s, key_channel=np.concatenate([half, half], axis=-1),
                   value_gram_diag=rng.lognormal(0.0, 0.5, (n_layers, 1, d)), sliding_window=window)


def vectors_10():
    """The format-1.0 vectors as kvz 0.1 made them (kept for reference; not regenerated)."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    return [
        # name, (tensors, meta) factory, compress kwargs, bank kwargs
        ("synth-tensor-extbank",
         lambda: _synthetic(2, 2, 300, 16, np.float16, 1),
         dict(eps=0.05, scope="tensor", config=CodecConfig(), embed_bank=False),
         dict(rank=4, rotations=False)),
        ("synth-object-embedded-align",
         lambda: _synthetic(3, 1, 300, 16, bf16, 2,
                            {"rope_pairing": "interleaved", "position_offset": "7"},
                            zero=("layers.1.value", 256, 300)),
         dict(eps=0.08, scope="object", config=CodecConfig(align=True, blend=True), embed_bank=True),
         dict(rank=None, rotations=True)),
        ("synth-pooled-f32-batch",
         lambda: _synthetic(2, 1, 100, 8, np.float32, 3, batch=True),
         dict(eps=0.02, scope="pooled", config=CodecConfig(object_size=32), embed_bank=True),
         dict(rank=2, rotations=False)),
        ("synth-constriction-coder",
         lambda: _synthetic(2, 1, 40, 8, np.float16, 4),
         dict(eps=0.05, scope="tensor", config=CodecConfig(object_size=16), embed_bank=True, coder="constriction"),
         dict(rank=None, rotations=False)),
        ("gemma3-270m-3l-300t",
         _real,
         dict(eps=0.03, scope="tensor", config=CodecConfig(), embed_bank=True),
         dict(rank=8, rotations=False)),
    ]


BLAS_THREADS = 1  # float results of OpenBLAS depend on its thread count: pin it (see kvz.md §9)


def _openblas_fns():
    """``(get, set)`` of the loaded OpenBLAS's thread count (ctypes), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "blas" in ln.lower() and ".so" in ln})
    except OSError:
        return None
    for lib in libs:
        try:
            dll = ctypes.CDLL(lib)
        except OSError:
            continue
        for pre in ("scipy_openblas", "openblas"):
            for suf in ("64_", ""):
                g, s = getattr(dll, f"{pre}_get_num_threads{suf}", None), getattr(dll, f"{pre}_set_num_threads{suf}", None)
                if g is not None and s is not None:
                    return g, s
    return None


@contextlib.contextmanager
def blas_threads(n: int):
    """Run with OpenBLAS limited to ``n`` threads (restored afterwards); yields the count set,
    or None when the BLAS cannot be controlled (then results may depend on the core count)."""
    import ctypes

    fns = _openblas_fns()
    if fns is None:
        yield None
        return
    get, set_ = fns
    old = int(get())
    set_(ctypes.c_int(n))
    try:
        yield int(get())
    finally:
        set_(ctypes.c_int(old))


def platform_fingerprint() -> dict:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # noqa: BLE001 - informative only
        blas = "unknown"
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"machine": platform.machine(), "system": platform.system(), "cpu": cpu, "numpy": np.__version__,
            "blas": blas, "blas_threads": BLAS_THREADS if _openblas_fns() else "uncontrolled"}


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def from_bits_dtype(bits: np.ndarray, dtype: str) -> np.ndarray:
    from alignpred.cache.layout import numpy_dtype

    return bits.view(numpy_dtype(dtype))


def make(name, factory, ckw, bkw, out=HERE) -> dict:
    tensors, meta = factory()
    p_in = os.path.join(out, f"{name}.input.safetensors")
    save_cache(p_in, tensors, meta)
    cache = load_cache(p_in)
    bank = fit_bank([cache], **bkw)
    p_kvz = os.path.join(out, f"{name}.kvz")
    files = {"input": os.path.basename(p_in), "kvz": os.path.basename(p_kvz)}
    if not ckw["embed_bank"]:
        p_bank = os.path.join(out, f"{name}.bank.h5")
        bank.save(p_bank)
        bank = Bank.load(p_bank)
        files["bank"] = os.path.basename(p_bank)
    if callable(ckw.get("attention_stats")):  # statistics made for this vector's bank
        ckw = dict(ckw, attention_stats=ckw["attention_stats"](bank))
    if callable(ckw.get("capture_stats")):  # the prefill statistics of this vector's cache
        ckw = dict(ckw, capture_stats=ckw["capture_stats"](cache))
    # synthetic keys are only said to carry RoPE: skip the check that they look rotated (it changes no byte)
    budget = ErrorBudget.from_options(**{k: v for k, v in ckw.items() if k not in ("config", "embed_bank", "coder")})
    prof = Profile(coder=ckw.get("coder", "rans4"), embed_bank=ckw["embed_bank"], trust_rope=True)
    info = compress(cache, p_kvz, budget=budget, bank=bank, profile=prof, config=ckw["config"])
    r = KvzReader(p_kvz, bank=None if ckw["embed_bank"] else bank, threads=1)
    dec = r.read()
    arrays = {f"dec.{k}": _bits(np.ascontiguousarray(v)) for k, v in dec.items()}
    if ckw.get("lossless"):
        arrays.update({f"coarse.{k}": _bits(np.ascontiguousarray(v)) for k, v in r.read(tier="coarse").items()})
    buf = open(p_kvz, "rb").read()
    n_obj = r.n_objects_per_tensor
    n_coarse = len(r.metas) * n_obj
    C = r.layout.kv_heads * r.layout.head_dim
    for k, e in enumerate(r.index):
        tier, kk = divmod(k, n_coarse)
        ti, j = divmod(kk, n_obj)
        if tier:  # refinement symbols: per-symbol models from the coarse decode's exponents
            from alignpred.codec.refine import contexts

            coarse = from_bits_dtype(arrays[f"coarse.{r.metas[ti].name}"], r.layout.dtype)
            blk = np.asarray(coarse[0] if r.layout.batch_dim else coarse)[:, j * r.config.object_size:
                                                                          j * r.config.object_size + e.n_tokens]
            ids = r.metas[ti].refine_models[contexts(blk.transpose(0, 2, 1)).reshape(-1)]
            q = (entropy.decode_ctx(buf[e.offset:e.offset + e.length], ids).reshape(C, e.n_tokens) if e.length
                 else np.zeros((C, e.n_tokens), np.int32))
            arrays[f"r.{ti}.{j}"] = q
            continue
        if e.length:
            q = entropy.decode(buf[e.offset:e.offset + e.length], r.metas[ti].models, (C, e.n_tokens),
                               coder=ckw.get("coder", "rans4"))
        else:
            q = np.zeros((C, e.n_tokens), np.int32)
        arrays[f"q.{ti}.{j}"] = q
    p_exp = os.path.join(out, f"{name}.expected.npz")
    np.savez_compressed(p_exp, **arrays)
    files["expected"] = os.path.basename(p_exp)
    ft = r.version
    from alignpred.format.container import parse_container

    parsed = parse_container(buf)
    return {
        "name": name,
        "files": files,
        "sha256": {k: _sha(os.path.join(out, v)) for k, v in files.items()},
        "format": ".".join(map(str, r.version)),
        "compress": {"eps": ckw["eps"], "eps_scope": ckw["scope"], "config": ckw["config"].to_json(),
                     "embed_bank": ckw["embed_bank"], "coder": ckw.get("coder", "rans4"),
                     "lossless": bool(ckw.get("lossless")),
                     "tensor_cap": ckw.get("tensor_cap", 3.0) if ckw["scope"] in ("pooled", "weighted", "attention")
                     else 0.0,
                     "weights": ckw.get("weights")},
        "bank_fit": {k: v for k, v in bkw.items()},
        "bank_id": bank.id,
        "dtype": r.layout.dtype,
        "facts": {"version": list(ft), "file_bytes": len(buf), "header_offset": parsed.footer.header_offset,
                  "header_length": parsed.footer.header_length, "index_offset": parsed.footer.index_offset,
                  "n_entries": len(parsed.index), "objects_per_tensor": n_obj,
                  "zero_objects": sum(1 for e in parsed.index if e.flags & 1 and not e.flags & 2),
                  "refine_objects": sum(1 for e in parsed.index if e.flags & 2),
                  "bank_embedded": bool(ckw["embed_bank"]), "bpv": info.bpv,
                  "nrmse_pooled": info.nrmse_pooled, "nrmse_max_tensor": info.nrmse_max_tensor},
    }


def main(argv=None) -> int:
    """Make the vectors the manifest does not hold yet; ``--regenerate NAME...`` remakes named ones
    (after a deliberate bitstream change, with a new format version). Committed vectors are never
    remade by default: every later version must still decode them as they are."""
    import argparse

    ap = argparse.ArgumentParser(description="kvz golden vectors")
    ap.add_argument("--regenerate", nargs="*", default=[], metavar="NAME", help="remake these vectors")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.regenerate) - {v[0] for v in vectors()})
    if unknown:
        ap.error(f"no such vector: {', '.join(unknown)} (1.0 vectors are frozen; the others: "
                 f"{', '.join(v[0] for v in vectors())})")
    manifest_path = os.path.join(HERE, "manifest.json")
    old = {}
    if os.path.exists(manifest_path):
        old = {v["name"]: v for v in json.load(open(manifest_path))["vectors"]}
    out = [dict(old[n], format="1.0") for n in FROZEN if n in old]
    for name, factory, ckw, bkw in vectors():
        if name in old and name not in args.regenerate:
            out.append(old[name])
            continue
        if factory in (_real, _real_v11, _real_v12) and not os.path.exists(REAL_SAMPLE):
            print(f"{name}: {REAL_SAMPLE} missing; keeping the old files", file=sys.stderr)
            if name in old:
                out.append(old[name])
            continue
        with blas_threads(BLAS_THREADS):
            v = make(name, factory, ckw, bkw)
        print(f"{name}: {v['facts']['file_bytes']} bytes, bpv {v['facts']['bpv']:.3f}, "
              f"nrmse {v['facts']['nrmse_pooled']:.4f}")
        out.append(v)
    man = {"about": "kvz golden vectors; new ones are made (committed ones kept) by: python format_spec/vectors/make_vectors.py",
           "tolerance": TOLERANCE, "platform": platform_fingerprint(), "vectors": out}
    with open(manifest_path, "w") as f:
        json.dump(man, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
