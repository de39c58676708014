"""How fast the entropy stage decodes, one study with three questions (``--study``):

* ``coders`` - size against the exact entropy of Laplace / Gaussian / Student-t symbols, and the
  speed of ``rans4`` and constriction (synthetic symbols; :mod:`.coders`);
* ``lanes`` - the ``lanes32`` decoders (numba, vectorised and portable, also compiled for AVX2-only
  and generic targets) against ``rans4`` on the real residual symbols of the sample caches, and the
  bits each probability precision costs (:mod:`.lanes`; ``benchmarks/results/entropy_lanes.{json,md}``);
* ``native`` - an independent C decoder of ``lanes32`` (``benchmarks/native/lanes32_avx2.c``, built
  with gcc) against numba's on the same symbols (:mod:`.native`; ``benchmarks/results/entropy_native.{json,md}``).

    python -m benchmarks.studies.speed.entropy_decode --study lanes     # from the repository root
    python -m benchmarks.studies.speed.entropy_decode --study native --quick --json /tmp/n.json
    python -m benchmarks.studies.speed.entropy_decode --study coders --quick --json /tmp/c.json

The symbols of ``lanes`` and ``native`` come from :func:`kvz.benchmarks.speed.entropy_stage.real_objects`,
the same the speed benchmark's entropy section times.
"""
from __future__ import annotations

import os

from kvz.benchmarks.harness import RESULTS, parser, run_study

from . import coders, lanes, native

STUDIES = {"coders": coders, "lanes": lanes, "native": native}
JSON = {"coders": os.path.join("out", "bench_entropy.json"), "lanes": os.path.join(RESULTS, "entropy_lanes.json"),
        "native": os.path.join(RESULTS, "entropy_native.json")}


def run(args) -> dict:
    """The study ``args.study`` names; its result carries ``"study"``."""
    return {"study": args.study, **STUDIES[args.study].run(args)}


def markdown(result: dict) -> str:
    return STUDIES[result.get("study", "lanes")].markdown(result)


def main(argv=None) -> dict:
    ap = parser(__doc__, caches="caches (default: the samples; lanes, native)",
                quick="fewer caches and rounds", json="JSON output (default: by study, see above)")
    ap.add_argument("--study", choices=sorted(STUDIES), default="lanes", help="which question (default lanes)")
    ap.add_argument("--rounds", type=int, default=None, help="timed calls per object and decoder "
                    "(default: lanes 20, native 200)")
    ap.add_argument("--objects", type=int, default=None, help="time only this many objects, evenly spaced "
                    "(correctness and sizes use all; default: lanes all, native 24)")
    lanes.add_args(ap)
    args = ap.parse_known_args(argv)[0]
    if args.worker:   # a lanes child process: one JSON line for its parent
        import json

        print(json.dumps(lanes.run(args)))
        return {}
    return run_study(ap, run, markdown, "studies.speed.entropy_decode", argv, json_default=JSON[args.study])
