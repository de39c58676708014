"""Start-up of kvz in a fresh process: the first start on a machine (numba's on-disk cache empty:
every kernel compiles) and a second start (the same cache: kernels load), each until
:func:`alignpred.warmup` has returned, i.e. until no request can meet a compile.

Every start is its own ``python -c`` process with ``NUMBA_CACHE_DIR`` set to one fresh temporary
folder (numba then caches there only, as on a machine where nothing ran yet). Measured inside the
child from its first statement: ``import alignpred`` (lazy: almost nothing), the API a request uses
(``from alignpred import compress, KvzReader``: numpy, numba, the codec), and the warm-up; the
parent measures the whole process (interpreter start and exit included). The modes are those the
vLLM connector warms: eps 0.02 lossy in the ``default`` and ``fast`` profiles, and lossless, on a
Gemma 3 270M-shaped cache (18 layers, 1 KV head, head_dim 256, 128 tokens, bfloat16, the bundled
bank). Second starts are repeated (the median is reported; the machine may be shared); one more
second start with ``full=True`` shows what the warm-up costs when it compresses and reads in every
mode instead of loading the kernels an earlier warm-up listed, and one ``kvz warmup`` process (the
command line skips numba's BLAS probe, an import of ``scipy.linalg`` at numba's first kernel load,
as every kvz command does; the library does not: it would change numba for the host's own code).

    python -m benchmarks.studies.speed.startup      # -> benchmarks/results/startup.{json,md}
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from kvz.benchmarks.harness import (
    BANK_NAME,
    RESULTS,
    clean_env,
    code_revision,
    command_line,
    loadavg,
    machine_info,
    median,
    parser,
    write_json,
    write_text,
)

CHILD = r"""
import time
t0 = time.perf_counter()
import alignpred
t_import = time.perf_counter() - t0
from alignpred import KvzReader, compress
t_api = time.perf_counter() - t0
import json, sys
opts = json.loads(sys.argv[1])
r = alignpred.warmup(**opts)
t_ready = time.perf_counter() - t0
print("KVZ-STARTUP " + json.dumps({"import_alignpred_s": t_import, "import_api_s": t_api, "ready_s": t_ready,
                                   "warmup": r}))
"""


def start(opts: dict, cache_dir: str) -> dict:
    """One fresh process: import, warm up with ``opts``; its timings (parent's ``process_s`` added)."""
    env = clean_env({"NUMBA_CACHE_DIR": cache_dir})
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(opts)], env=env, capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    line = next((x for x in p.stdout.splitlines() if x.startswith("KVZ-STARTUP ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = json.loads(line[len("KVZ-STARTUP "):])
    out["process_s"] = wall
    return out


def cli_start(opts: dict, cache_dir: str) -> dict:
    """``kvz warmup`` with the same request, in its own process."""
    cmd = [sys.executable, "-m", "kvz.cli.main", "warmup", "--tokens", str(opts["shape"][2]), "--eps", str(opts["eps"]),
           "--json"] + [x for p in opts["profiles"] for x in ("--profile", p)] + ([] if opts["lossless"] else
                                                                                 ["--no-lossless"])
    t = time.perf_counter()
    p = subprocess.run(cmd, env=clean_env({"NUMBA_CACHE_DIR": cache_dir}), capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"kvz warmup failed ({p.returncode}):\n{p.stderr[-3000:]}")
    w = json.loads(p.stdout[p.stdout.index("{"):])
    return {"process_s": wall, "warmup_s": w["total_s"], "how": w["how"], "compile_count": w["compile_count"],
            "cache_loads": w["cache_loads"], "warnings": w["warnings"]}


def summary(run: dict) -> dict:
    w = run["warmup"]
    steps = {s["step"]: s["seconds"] for s in w["steps"]}
    return {"process_s": run["process_s"], "import_alignpred_s": run["import_alignpred_s"],
            "import_api_s": run["import_api_s"], "warmup_s": w["total_s"], "ready_s": run["ready_s"],
            "how": w["how"], "compile_count": w["compile_count"], "cache_loads": w["cache_loads"],
            "load_s": steps.get("load"), "warnings": w["warnings"]}


def measure(opts: dict, repeats: int, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvz-numba-") as d:
        log(f"first start (empty numba cache {d}) ...")
        first = start(opts, d)
        log(f"  ready {first['ready_s']:.2f} s, {first['warmup']['compile_count']} kernels compiled")
        seconds = []
        for i in range(repeats):
            seconds.append(start(opts, d))
            log(f"second start {i + 1}: ready {seconds[-1]['ready_s']:.2f} s "
                f"({seconds[-1]['warmup']['how']}, {seconds[-1]['warmup']['compile_count']} compiled)")
        full = start({**opts, "full": True}, d)
        log(f"second start, full run: ready {full['ready_s']:.2f} s")
        cli = cli_start(opts, d)
        log(f"kvz warmup: process {cli['process_s']:.2f} s ({cli['how']}, {cli['compile_count']} compiled)")
    keys = ("process_s", "import_api_s", "warmup_s", "ready_s")
    med = {k: median([summary(s)[k] for s in seconds]) for k in keys}
    return {"first": summary(first), "first_steps": first["warmup"]["steps"], "second": [summary(s) for s in seconds],
            "second_median": med, "second_full": summary(full), "second_full_steps": full["warmup"]["steps"],
            "compiled_first": first["warmup"]["compiled"], "cli_second": cli}


def markdown(res: dict) -> str:
    m = res["machine"]
    rows = [("first start (empty cache)", res["first"])] + \
        [(f"second start #{i + 1}", s) for i, s in enumerate(res["second"])] + \
        [("second start, `full=True`", res["second_full"])]
    lines = [
        "# kvz start-up: first and second process", "",
        f"`{res['command']}` — {m['cpu']} ({m.get('usable_cores')} usable cores), Python {m['python']}, numba "
        f"{res['numba']}, revision `{res['revision']}`; load average before/after {res['load_before']} / "
        f"{res['load_after']} (a shared machine).", "",
        f"Warm-up: `alignpred.warmup(**{json.dumps(res['options'])})` — every mode the vLLM connector warms, "
        "each process with `NUMBA_CACHE_DIR` on one fresh folder.", "",
        "| start | process s | `import alignpred` s | + `from alignpred import compress, KvzReader` s | warm-up s "
        "| ready s | how | compiled | loaded |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for label, s in rows:
        lines.append(f"| {label} | {s['process_s']:.2f} | {s['import_alignpred_s']:.3f} | {s['import_api_s']:.2f} | "
                     f"{s['warmup_s']:.2f} | {s['ready_s']:.2f} | {s['how']} | {s['compile_count']} | "
                     f"{s['cache_loads']} |")
    c = res["cli_second"]
    lines.append(f"| second start, `kvz warmup` | {c['process_s']:.2f} | - | - | {c['warmup_s']:.2f} | - | {c['how']} | "
                 f"{c['compile_count']} | {c['cache_loads']} |")
    med = res["second_median"]
    lines += ["", f"Second start, median of {len(res['second'])}: ready **{med['ready_s']:.2f} s** after the "
              f"process starts (imports {med['import_api_s']:.2f} s, warm-up {med['warmup_s']:.2f} s; whole process "
              f"{med['process_s']:.2f} s). First start: ready {res['first']['ready_s']:.1f} s, "
              f"{res['first']['compile_count']} kernel compiles.", "",
              "*ready*: from the child's first statement to `warmup()` returned (the interpreter's own start, "
              "~0.02 s, is in *process* only). *how*: `loaded` = the kernels an earlier warm-up listed were loaded "
              "from numba's cache; `run` = compress and read in every mode. *compiled*: numba compile events of kvz "
              "kernels; *loaded*: kernel versions read from numba's on-disk cache.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = parser(__doc__, quick="one second start, the fast profile lossy only", json="JSON output",
                json_default=os.path.join(RESULTS, "startup.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "startup.md"), metavar="OUT", help="Markdown output")
    ap.add_argument("--tokens", type=int, default=128, help="positions of the synthetic cache (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="second starts (default 3)")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        ap.error("--tokens must be >= 2 and --repeats >= 1")
    args.command = command_line("studies.speed.startup", argv)
    res = run(args)
    if args.json:
        write_json(res, args.json)
    if args.md:
        write_text(args.md, markdown(res))
    print(markdown(res))


def run(args) -> dict:
    """A first start and ``args.repeats`` second starts (``--quick``: one, the fast profile only)."""
    opts = {"profiles": ["fast"] if args.quick else ["default", "fast"], "lossless": not args.quick,
            "bank": BANK_NAME, "shape": [18, 1, args.tokens, 256], "dtype": "bfloat16", "eps": 0.02}
    import numba

    load_before = loadavg()
    res = measure(opts, 1 if args.quick else args.repeats, log=lambda s: print(s, file=sys.stderr, flush=True))
    res.update({"command": args.command, "options": opts, "machine": machine_info(()),
                "numba": numba.__version__, "revision": code_revision(), "load_before": load_before,
                "load_after": loadavg()})
    return res


if __name__ == "__main__":
    main()
