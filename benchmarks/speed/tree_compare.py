"""This tree against another commit of kvz, same run: ``python -m kvz.benchmarks.speed.tree_compare
--ref 0e971f0`` (the last commit before the 0.3 restructure) checks "same speed within noise, same
bytes" after a change that should not alter behaviour.

Both trees are measured by the speed benchmark's fresh-process worker (:mod:`.worker`: warm-up,
``compress`` then ``KvzReader(...).read()``, with each thread count), alternating tree by tree and
round by round on the same caches, each with its own bundled bank. The reference is a detached git
worktree (``--ref-dir``, added if absent). Reported per tree: encode and decode values/s (sum over
caches of per-cache medians, wall and CPU), bpv, and whether the file bytes and decoded arrays are
identical between the trees (digests).

Example::

    python -m kvz.benchmarks.speed.tree_compare --ref 0e971f0 --rounds 3 \\
        --json benchmarks/results/speed-vs-0e971f0.json --md benchmarks/results/speed-vs-0e971f0.md
"""
from __future__ import annotations

import os

from ..harness import (
    ROOT,
    WARM_SAMPLE,
    command_line,
    default_caches,
    display_path,
    loadavg,
    machine_info,
    median,
    parser,
    stem,
    write_json,
    write_text,
)
from .config import log
from .processes import _worker_stat, ensure_kvz01, run_worker

__all__ = ["bank_of_tree", "compare", "main"]

BANK_PATHS = ("alignpred/bank/data/gemma-3-270m.h5", "alignpred/banks/gemma-3-270m.h5",
              "samples/gemma3-270m/bank.h5")


def bank_of_tree(tree: str) -> str:
    """The bundled Gemma 3 270M bank file of a kvz tree (its location moved between versions)."""
    for rel in BANK_PATHS:
        p = os.path.join(tree, rel)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"no bundled gemma-3-270m bank in {tree} (looked for {', '.join(BANK_PATHS)})")


def _rate(runs: list[dict], kind: str, th: str, what: str) -> float | None:
    t, n = _worker_stat(runs, kind, th, what)
    return n / t if t else None


def summarize(runs: list[dict], labels: tuple[str, str], threads: list[int]) -> dict:
    cur, ref = labels
    out: dict = {"trees": {}}
    for lab in labels:
        rs = [r for r in runs if r["label"] == lab]
        t = {"bpv": {r["cache"]: r["bpv"] for r in rs}, "file_bytes": {r["cache"]: r["file_bytes"] for r in rs}}
        for kind in ("encode", "decode"):
            for th in map(str, threads):
                for what in ("wall", "cpu"):
                    t[f"{kind}_{what}_mvps_t{th}"] = (_rate(rs, kind, th, what) or float("nan")) / 1e6
        out["trees"][lab] = t
    a, b = out["trees"][cur], out["trees"][ref]
    out["ratio_cur_over_ref"] = {k: a[k] / b[k] for k in a if k.endswith(tuple(f"_t{t}" for t in threads)) and b[k]}
    dig: dict = {}
    for r in runs:
        dig.setdefault(r["cache"], {}).setdefault(r["label"], set()).update(r["digest"].values())
    out["decoded_identical"] = {c: len(d.get(cur, set()) | d.get(ref, set())) == 1 and len(d) == 2
                                for c, d in dig.items()}
    out["bytes_identical"] = {c: a["file_bytes"].get(c) == b["file_bytes"].get(c) for c in a["file_bytes"]}
    return out


def compare(ref: str, ref_dir: str, caches: list[str], *, threads=(1, 2), rounds: int = 3, rep_enc: int = 1,
            rep_dec: int = 3) -> dict:
    ok, how = ensure_kvz01(ref_dir, ref)
    if not ok:
        raise RuntimeError(how)
    labels = ("this tree", f"kvz {ref}")
    trees = {labels[0]: ROOT, labels[1]: ref_dir}
    runs = []
    jobs = [(r, c, lab) for r in range(rounds) for c in caches for lab in (labels if r % 2 == 0 else labels[::-1])]
    for i, (r, c, lab) in enumerate(jobs):
        tree = trees[lab]
        res = run_worker(tree, c, bank_of_tree(tree), WARM_SAMPLE, list(threads), None, rep_enc, rep_dec)
        res.update(round=r, cache=stem(c), label=lab, loadavg=loadavg(),
                   module=os.path.relpath(res["module"], tree), env={})  # no machine paths in the results
        runs.append(res)
        d = ", ".join(f"t={t} {res['n_values'] / median(v['wall']) / 1e6:.1f}" for t, v in res["decode"].items())
        log(f"{i + 1}/{len(jobs)} {lab} {res['cache']}: decode {d} Mv/s, bpv {res['bpv']:.4f}, load {loadavg()}")
    return {"ref": ref, "caches": [display_path(c) for c in caches],
            "threads": list(threads), "rounds": rounds, "machine": machine_info(), "runs": runs,
            "summary": summarize(runs, labels, list(threads))}


def markdown(res: dict, command: str) -> str:
    s = res["summary"]
    labs = list(s["trees"])
    lines = [f"# Speed: this tree against kvz {res['ref']} (same run)", "", f"Command: `{command}`", "",
             f"Caches: {', '.join(res['caches'])}; {res['rounds']} rounds, trees alternating; fresh process per "
             "measurement (the speed benchmark's worker); values/s = sum over caches of per-cache medians.", "",
             "| | " + " | ".join(labs) + " | this / ref |", "|---|" + "---:|" * (len(labs) + 1)]
    keys = [k for k in s["trees"][labs[0]] if k.endswith(tuple(f"_t{t}" for t in res["threads"]))]
    for k in keys:
        vals = " | ".join(f"{s['trees'][lab][k]:.2f}" for lab in labs)
        kind, what, _, th = k.split("_")
        lines.append(f"| {kind} M values/s ({what}), {th[1:]} thread(s) | {vals} | "
                     f"{s['ratio_cur_over_ref'].get(k, float('nan')):.3f} |")
    lines += ["", "| cache | bpv (" + " / ".join(labs) + ") | same file bytes | same decoded arrays |",
              "|---|---|---|---|"]
    for c in s["bytes_identical"]:
        bp = " / ".join(f"{s['trees'][lab]['bpv'].get(c, float('nan')):.4f}" for lab in labs)
        lines.append(f"| {c} | {bp} | {s['bytes_identical'][c]} | {s['decoded_identical'].get(c)} |")
    loads = [r["loadavg"][0] for r in res["runs"] if r.get("loadavg")]
    if loads:
        lines += ["", f"Load average during the run: {min(loads):.1f}-{max(loads):.1f} (1-minute)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = parser(__doc__, caches="caches (default: data/eval, else the bundled samples)", json="results JSON")
    ap.add_argument("--ref", default="0e971f0", help="the commit to compare against")
    ap.add_argument("--ref-dir", default=None, help="its worktree (default: a temp path named after the commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    import tempfile

    ref_dir = a.ref_dir or os.path.join(tempfile.gettempdir(), f"kvz-{a.ref}")
    res = compare(a.ref, ref_dir, default_caches(a.caches or None),
                  threads=[int(t) for t in a.threads.split(",")], rounds=a.rounds)
    cmd = command_line("speed.tree_compare", argv).strip()
    res["command"] = cmd
    if a.json:
        write_json(res, a.json)
    md = markdown(res, cmd)
    if a.md:
        write_text(a.md, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
