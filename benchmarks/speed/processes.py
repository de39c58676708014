"""Sections 2 and 4: fresh worker processes (:mod:`.worker`) of kvz 0.1 and of this tree, and of this
tree under the thread-variable variants, interleaved round by round; their summaries (speed-ups
against 0.1, default environment against each variant)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

from ..harness import ROOT, WARM_SAMPLE, children_cpu, clean_env, loadavg, median, parse_env, stem
from .config import BLAS1, ENV_TOLERANCE, EPS, KVZ01_COMMIT, KVZ01_DIR, RESULT_TAG, SCOPE, log


def result_line(p: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON result a worker printed (``KVZ-SPEED-RESULT {...}``); RuntimeError if it failed."""
    line = next((x for x in p.stdout.splitlines() if x.startswith(RESULT_TAG)), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{what} failed with status {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return json.loads(line[len(RESULT_TAG):])


def run_worker(tree: str, cache: str, bank: str, warm: str, threads: list, env_extra: dict | None, rep_enc: int,
               rep_dec: int, eps: float = EPS, timeout: float = 1800) -> dict:
    """One measurement in a fresh interpreter importing ``alignpred`` from ``tree``."""
    args = {"cache": os.path.abspath(cache), "bank": os.path.abspath(bank), "warm": os.path.abspath(warm),
            "threads": threads, "rep_enc": rep_enc, "rep_dec": rep_dec, "eps": eps, "scope": SCOPE}
    k0, t0 = children_cpu(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvz-speed-cwd-") as cwd:  # never the repository: it would shadow
        p = subprocess.run([sys.executable, "-m", "kvz.benchmarks.speed.worker", json.dumps(args)],
                           capture_output=True, text=True, env=clean_env(env_extra, tree), cwd=cwd, timeout=timeout)
    wall = time.perf_counter() - t0
    res = result_line(p, f"worker ({tree}, env {env_extra})")
    res["process_wall_s"] = wall
    res["process_cpu_s"] = children_cpu() - k0
    return res


def ensure_kvz01(path: str = KVZ01_DIR, commit: str = KVZ01_COMMIT) -> tuple[bool, str]:
    """The kvz 0.1 tree at ``path`` (a detached git worktree of ``commit``, added if absent)."""
    if os.path.isfile(os.path.join(path, "alignpred", "__init__.py")):
        return True, f"{path} (existing)"
    try:
        p = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit], capture_output=True,
                           text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"git worktree add failed: {e}"
    if p.returncode != 0:
        return False, f"git worktree add {path} {commit} failed: {p.stderr.strip()[-500:]}"
    return True, f"{path} (git worktree add --detach {path} {commit})"


def version_env_section(cache_paths: list[str], *, bank_path: str, kvz01: str | None, threads: list[int],
                        proc_rounds: int, env_rounds: int, env_variants, rep_enc: int, rep_dec: int,
                        env_caches: int = 1, progress: bool = True) -> dict:
    """kvz 0.1 vs this tree (default environment), and this tree under the thread-variable variants,
    each a fresh worker process; jobs interleaved round by round."""
    cur_warm = WARM_SAMPLE
    jobs: list[tuple[int, int, str, str | None]] = []  # (round, cache index, label, env spec)
    for r in range(max(proc_rounds, env_rounds)):
        for ci in range(len(cache_paths)):
            js = []
            if r < proc_rounds:
                if kvz01:
                    js += [(r, ci, "kvz 0.1", None), (r, ci, "kvz 0.1", BLAS1)]
                js.append((r, ci, "kvz 0.2", None))
            if r < env_rounds and ci < env_caches:
                if not (r < proc_rounds):
                    js.append((r, ci, "kvz 0.2", None))
                js += [(r, ci, "kvz 0.2", spec) for spec in env_variants]
            k = (r + ci) % max(len(js), 1)
            js = js[k:] + js[:k]
            jobs += js[::-1] if r % 2 else js
    runs = []
    for i, (r, ci, label, spec) in enumerate(jobs):
        old = label == "kvz 0.1"
        tree = kvz01 if old else ROOT
        warm = os.path.join(kvz01, "samples", "gemma3-270m", "english-prose.safetensors") if old else cur_warm
        bank = os.path.join(kvz01, "samples", "gemma3-270m", "bank.h5") if old else bank_path
        res = run_worker(tree, cache_paths[ci], bank, warm, [None] if old else threads,
                         parse_env(spec) if spec else None, rep_enc, rep_dec)
        res.update(round=r, cache=stem(cache_paths[ci]), label=label,
                   env=spec or "default", loadavg=loadavg())
        runs.append(res)
        if progress:
            nv = res["n_values"]
            e = ", ".join(f"enc t={t} {nv / median(v['wall']) / 1e6:.2f}" for t, v in res["encode"].items())
            d = ", ".join(f"dec t={t} {nv / median(v['wall']) / 1e6:.2f}" for t, v in res["decode"].items())
            log(f"worker {i + 1}/{len(jobs)} {label} [{spec or 'default'}] {res['cache']}: {e}; {d} Mv/s "
                f"(bpv {res['bpv']:.4f}, load {loadavg()})")
    return {"runs": runs, "summary": summarize_versions(runs), "env": summarize_env(runs)}


def _worker_stat(runs: list[dict], kind: str, th: str, what: str = "wall") -> tuple[float, int]:
    """Total over caches of the per-cache medians (over rounds and repeats), and the values."""
    per: dict = {}
    for r in runs:
        if th in r[kind]:
            per.setdefault(r["cache"], {"n": r["n_values"], "x": []})["x"] += r[kind][th][what]
    return sum(median(p["x"]) for p in per.values()), sum(p["n"] for p in per.values())


def summarize_versions(runs: list[dict]) -> dict:
    """kvz 0.1 vs this tree on the caches both ran: values/s (totals over caches of per-cache medians)
    and bpv. 0.1 ran under the default environment and with single-thread BLAS (``blas1``); the
    speed-ups (``*_speedup_t{threads}``) are taken against the better of the two 0.1 figures, the
    conservative reading of "today's speed"; ``*_speedup_vs_default_t*`` against its default run."""
    new = [r for r in runs if r["label"] == "kvz 0.2" and r["env"] == "default"]
    old_all = [r for r in runs if r["label"] == "kvz 0.1"]
    if not new:
        return {}
    out: dict = {"caches": sorted({r["cache"] for r in new})}
    if old_all:
        both = sorted({r["cache"] for r in old_all} & {r["cache"] for r in new})
        new = [r for r in new if r["cache"] in both]
        old_all = [r for r in old_all if r["cache"] in both]
        out["caches"] = both
    olds = {}
    for r in old_all:
        olds.setdefault("0.1" if r["env"] == "default" else "0.1_blas1", []).append(r)
    out["kvz01_envs"] = {tag: sorted({r["env"] for r in rs}) for tag, rs in olds.items()}
    bpv: dict = {}
    for r in old_all + new:
        tag = r["label"] + ("" if r["env"] == "default" else " [blas1]")
        bpv.setdefault(r["cache"], {})[tag] = r["bpv"]
    out["bpv"] = bpv
    if old_all:
        out["bpv_diff_max"] = max(abs(v["kvz 0.2"] - x) for v in bpv.values() for k, x in v.items()
                                  if k.startswith("kvz 0.1"))
    for kind in ("encode", "decode"):
        for what in ("wall", "cpu"):
            for tag, rs in olds.items():
                t_old, n_old = _worker_stat(rs, kind, "None", what)
                out[f"{kind}_{what}_vps_{tag}"] = n_old / t_old
            best = max((out[f"{kind}_{what}_vps_{tag}"] for tag in olds), default=None)
            if best is not None:
                out[f"{kind}_{what}_vps_0.1_best"] = best
            for th in sorted({t for r in new for t in r[kind]}, key=int):
                t_new, n_new = _worker_stat(new, kind, th, what)
                v = out[f"{kind}_{what}_vps_0.2_t{th}"] = n_new / t_new
                if best is not None:
                    out[f"{kind}_{what}_speedup_t{th}"] = v / best
                if "0.1" in olds:
                    out[f"{kind}_{what}_speedup_vs_default_t{th}"] = v / out[f"{kind}_{what}_vps_0.1"]
    digests: dict = {}
    for r in new:
        for d in r["digest"].values():
            digests.setdefault(r["cache"], set()).add(d)
    out["decode_identical_across_processes_and_threads"] = all(len(s) == 1 for s in digests.values())
    out["digests"] = {k: sorted(v) for k, v in digests.items()}
    return out


def _separated(d: list[dict], x: list[dict], kind: str, th: str, what: str) -> bool:
    """Whether on every cache each default sample is slower than every variant sample."""
    caches = {r["cache"] for r in x}
    for c in caches:
        ds = [t for r in d if r["cache"] == c and th in r[kind] for t in r[kind][th][what]]
        xs = [t for r in x if r["cache"] == c and th in r[kind] for t in r[kind][th][what]]
        if not ds or not xs or min(ds) <= max(xs):
            return False
    return bool(caches)


def summarize_env(runs: list[dict]) -> dict:
    """Per env variant and (op, threads): the default's median time over the variant's, on the caches
    both ran. A run is flagged when the default is slower by more than the tolerance in wall *and* CPU
    time with every default sample slower than every variant sample: a library pool fighting kvz's
    threads costs both (spinning threads) and shows in every sample, while a difference within the
    samples' spread, or in wall time alone, is the shared machine's noise (listed under ``noise``)."""
    cur = [r for r in runs if r["label"] == "kvz 0.2"]
    variants = sorted({r["env"] for r in cur} - {"default"})
    out: dict = {"tolerance": ENV_TOLERANCE, "variants": {}, "flags": [], "noise": []}
    for v in variants:
        caches = {r["cache"] for r in cur if r["env"] == v}
        d = [r for r in cur if r["env"] == "default" and r["cache"] in caches]
        x = [r for r in cur if r["env"] == v]
        res = {}
        for kind in ("encode", "decode"):
            for th in sorted({t for r in x for t in r[kind]}, key=int):
                for what in ("wall", "cpu"):
                    td, _ = _worker_stat(d, kind, th, what)
                    tv, _ = _worker_stat(x, kind, th, what)
                    ratio = td / tv if tv > 0 else math.nan
                    res[f"{kind}_t{th}_{what}"] = {"default_s": td, "variant_s": tv, "default_over_variant": ratio,
                                                   "separated": _separated(d, x, kind, th, what)}
                w, c = res[f"{kind}_t{th}_wall"], res[f"{kind}_t{th}_cpu"]
                slower = w["default_over_variant"] > 1 + ENV_TOLERANCE
                msg = (f"{kind} threads={th}: default {w['default_s']:.3f} s vs {v} {w['variant_s']:.3f} s "
                       f"({(w['default_over_variant'] - 1) * 100:.0f}% slower; CPU "
                       f"{(c['default_over_variant'] - 1) * 100:+.0f}%)")
                if slower and c["default_over_variant"] > 1 + ENV_TOLERANCE and w["separated"] and c["separated"]:
                    out["flags"].append(msg)
                elif slower:
                    out["noise"].append(msg + " - within the samples' spread or in wall time only")
        out["variants"][v] = {"caches": sorted(caches), "rounds": len({r['round'] for r in x}), **res}
    return out
