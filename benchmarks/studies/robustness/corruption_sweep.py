"""Single-byte corruption sweep of a .kvz file: is every damaged byte detected?

Compresses a real sample (bank fitted on the *other* samples, or ``--embed``: fitted on the
sample itself and embedded), then corrupts one byte at a time — every byte of the preamble,
payloads, embedded bank, header, index and footer (or every ``--stride``-th) — and asks the
library's reader whether the file is damaged:

* preamble, header, index, footer: a fresh ``KvzReader`` (which verifies the footer, header
  and index checksums and validates everything on open) plus ``verify()`` (payload and bank
  checksums);
* payload and embedded-bank bytes: one reader over a mutable in-memory image, ``verify([k])``
  of the object that holds the byte (its CRC is what the reader checks before decoding that
  object), or ``verify([], bank=True)`` (the bank CRC checked before the bank is parsed). A sample of
  payload corruptions is also pushed through a real decode (``read(tokens, layers)``) to show
  that the decode path raises the same ChecksumError before decoding.

A position counts as detected if the reader raises a ``KvzError``. Usage::

    python -m benchmarks.studies.robustness.corruption_sweep                       # english-prose, every byte, one mask
    python -m benchmarks.studies.robustness.corruption_sweep --embed --stride 7 --masks 0x01,0x80,0xff
    python -m benchmarks.studies.robustness.corruption_sweep --json out/corruption.json
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

from kvz.benchmarks.harness import WARM_SAMPLE, caches_in, parser, write_json


def regions(raw: bytes) -> dict:
    from alignpred.format import PREAMBLE_SIZE, parse_container

    p = parse_container(raw)
    pay_end = max((e.offset + e.length for e in p.index), default=PREAMBLE_SIZE)
    ft = p.footer
    return {"preamble": (0, PREAMBLE_SIZE), "payload": (PREAMBLE_SIZE, pay_end), "bank": (pay_end, ft.header_offset),
            "header": (ft.header_offset, ft.index_offset), "index": (ft.index_offset, ft.index_offset + ft.index_length),
            "footer": (ft.index_offset + ft.index_length, len(raw))}


def sweep(raw: bytes, bank=None, *, stride: int = 1, masks=(None,), decode_samples: int = 50, seed: int = 0,
          progress: bool = False) -> dict:
    """Corrupt ``raw`` one byte at a time; returns per-region counts of tried/detected and the
    undetected positions. ``masks``: XOR values; ``None`` = one random non-zero mask per byte."""
    from alignpred import KvzError, KvzReader

    rng = np.random.default_rng(seed)
    res = {}
    # every reader reads the file from memory: ``buf`` itself (a bytearray is read without a copy)
    ref = KvzReader(bytes(raw), bank=bank)
    ref.verify()
    reg = regions(raw)
    # payload: which entry holds each byte
    starts = np.array([e.offset for e in ref.index])
    buf = bytearray(raw)
    payload_reader = KvzReader(buf, bank=bank)
    t0 = time.time()
    for name, (a, b) in reg.items():
        tried = detected = 0
        missed = []
        for i in range(a, b, stride):
            for m in masks:
                mask = int(rng.integers(1, 256)) if m is None else m
                buf[i] ^= mask
                try:
                    if name == "payload":
                        k = int(np.searchsorted(starts, i, side="right") - 1)
                        payload_reader.verify([k])
                    elif name == "bank":
                        payload_reader.verify([], bank=True)
                    else:
                        KvzReader(buf, bank=bank).verify()
                    missed.append((i, mask))
                except KvzError:
                    detected += 1
                finally:
                    buf[i] ^= mask
                tried += 1
        res[name] = {"bytes": b - a, "tried": tried, "detected": detected, "undetected": missed[:20]}
        if progress:
            print(f"  {name:8s} {b - a:9d} bytes  {tried:9d} tried  {detected:9d} detected  "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr)
    # the decode path: damaged payloads raise before anything is decoded
    S = ref.config.object_size
    dec_tried = dec_detected = 0
    a, b = reg["payload"]
    live = [k for k, e in enumerate(ref.index) if e.length]
    for k in rng.choice(live, size=min(decode_samples, len(live)), replace=False) if live else []:
        e = ref.index[int(k)]
        i = e.offset + int(rng.integers(e.length))
        buf[i] ^= 0xFF
        try:
            j = e.token_start // S
            KvzReader(buf, bank=bank).read(tokens=(j * S, j * S + e.n_tokens), layers=e.tensor // 2 + 1)
        except KvzError:
            dec_detected += 1
        finally:
            buf[i] ^= 0xFF
        dec_tried += 1
    res["decode_path"] = {"tried": dec_tried, "detected": dec_detected}
    tot = sum(v["tried"] for k, v in res.items() if k != "decode_path")
    det = sum(v["detected"] for k, v in res.items() if k != "decode_path")
    res["total"] = {"tried": tot, "detected": det, "rate": det / tot if tot else 1.0}
    return res


def main(argv=None) -> int:
    ap = parser(__doc__, json="write the result here")
    ap.add_argument("--sample", default=WARM_SAMPLE)
    ap.add_argument("--embed", action="store_true", help="self-calibrated bank embedded in the file")
    ap.add_argument("--eps", type=float, default=0.03)
    ap.add_argument("--stride", type=int, default=1, help="corrupt every N-th byte")
    ap.add_argument("--masks", default="random", help="'random' (one per byte) or comma-separated XOR values")
    ap.add_argument("--decode-samples", type=int, default=10)
    args = ap.parse_args(argv)
    res = run(args)
    t = res["total"]
    print(markdown(res))
    if args.json:
        write_json(res, args.json)
    return 0 if t["detected"] == t["tried"] and res["decode_path"]["detected"] == res["decode_path"]["tried"] else 1


def run(args) -> dict:
    """One sample compressed, then every ``args.stride``-th byte corrupted and the file checked."""
    from alignpred import compress, fit_bank, load_cache
    from alignpred.codec import Profile

    cache = load_cache(args.sample)
    if args.embed:
        bank = fit_bank([cache], rank=16, rotations=False)
    else:
        others = [p for p in caches_in(os.path.dirname(args.sample))
                  if os.path.abspath(p) != os.path.abspath(args.sample)]
        bank = fit_bank([load_cache(p) for p in others] or [cache], rank=16, rotations=False)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "sweep.kvz")
        info = compress(cache, out, budget=args.eps, bank=bank, profile=Profile(embed_bank=args.embed))
        raw = open(out, "rb").read()
    masks = (None,) if args.masks == "random" else tuple(int(m, 0) for m in args.masks.split(","))
    print(f"{args.sample}: {len(raw)} bytes ({info.bpv:.3f} bpv), bank {'embedded' if args.embed else 'external'}, "
          f"stride {args.stride}, masks {args.masks}", file=sys.stderr)
    t0 = time.time()
    res = sweep(raw, None if args.embed else bank, stride=args.stride, masks=masks,
                decode_samples=args.decode_samples, progress=True)
    res["file_bytes"] = len(raw)
    res["seconds"] = time.time() - t0
    res["settings"] = {"sample": os.path.basename(args.sample), "embed": args.embed, "eps": args.eps,
                       "stride": args.stride, "masks": args.masks}
    return res


def markdown(res: dict) -> str:
    t, s = res["total"], res["settings"]
    return (f"# Corruption sweep: {s['sample']}, eps {s['eps']}, bank {'embedded' if s['embed'] else 'external'}\n\n"
            f"detected {t['detected']} / {t['tried']} single-byte corruptions ({100 * t['rate']:.4f} %; stride "
            f"{s['stride']}, masks {s['masks']}, {res['file_bytes']} bytes); decode path "
            f"{res['decode_path']['detected']} / {res['decode_path']['tried']}; {res['seconds']:.0f} s\n")


if __name__ == "__main__":
    sys.exit(main())
