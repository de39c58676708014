"""The command line of the speed benchmark (``python -m kvz.benchmarks.speed``)."""
from __future__ import annotations

import argparse
import os

from ..harness import RESULTS, command_line, parser
from .config import BANK, CODECS, KVZ01_COMMIT, KVZ01_DIR, QUIET, SECTIONS
from .runner import print_acceptance, render, run


def main(argv=None) -> dict:
    """``python -m kvz.benchmarks.speed``: run (or ``--render``) and print the acceptance lines."""
    from kvz.benchmarks import speed

    ap = parser(speed.__doc__, caches="2,048-token caches (default: data/eval/*.safetensors)",
                quick="two caches, fewer repeats, a 4,096-token prefill",
                json="results JSON (default: benchmarks/results/speed[-quick].json)", quiet=True)
    ap.add_argument("--plot", default=None, help="plot PNG (default: next to the JSON)")
    ap.add_argument("--md", default=None, help="Markdown summary (default: next to the JSON)")
    ap.add_argument("--bank", default=BANK)
    ap.add_argument("--codecs", default=",".join(CODECS), help=f"subset of {','.join(CODECS)}")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--kvz01", default=KVZ01_DIR, help=f"kvz 0.1 tree (a worktree of {KVZ01_COMMIT}; made if absent)")
    ap.add_argument("--prefill-tokens", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--n-caches", type=int)
    ap.add_argument("--command", help=argparse.SUPPRESS)  # the command line to record (kvz bench --speed)
    ap.add_argument("--render", metavar="JSON", help="only re-summarise an existing results JSON (and its .md, .png)")
    a = ap.parse_args(argv)
    QUIET["on"] = a.quiet
    if a.render:
        res = render(a.render, a.plot, a.md)
        print_acceptance(res)
        return res
    preset = "quick" if a.quick else "full"
    ov = {k: v for k, v in (("prefill_tokens", a.prefill_tokens), ("rounds", a.rounds), ("n_caches", a.n_caches))
          if v is not None}
    base = os.path.join(RESULTS, "speed-quick" if a.quick else "speed")
    js = a.json or base + ".json"
    stem = os.path.splitext(js)[0]
    cmd = command_line("speed", argv)
    res = run(preset, a.caches or None, bank=a.bank, codecs=[c for c in a.codecs.split(",") if c],
              sections=[s for s in a.sections.split(",") if s], kvz01=a.kvz01, overrides=ov, json_out=js,
              plot_out=a.plot or stem + ".png", md_out=a.md or stem + ".md", command=a.command or cmd.strip(),
              progress=not a.quiet)
    print_acceptance(res)
    print(f"wrote {js}")
    return res
