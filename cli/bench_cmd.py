"""``kvz bench``: a thin click layer over :func:`benchmarks.run.run_bench`."""
from __future__ import annotations

import glob
import os
import shlex

import click


def _command_line(caches, opts: list[tuple[str, object]]) -> str:
    """The command as typed, rebuilt from the parsed parameters; paths outside the repository shown by name."""
    from kvz.benchmarks.harness import display_path

    out = ["kvz", "bench"] + [display_path(c) for c in caches]
    for flag, v in opts:
        if v is None or v is False or v == ():
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            for x in v:
                out += [flag, display_path(x) if os.path.exists(x) else str(x)]
        else:
            out += [flag, display_path(v) if isinstance(v, str) and os.path.exists(v) else str(v)]
    return " ".join(shlex.quote(x) for x in out)


@click.command("bench")
@click.argument("caches", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--bank", type=click.Path(dir_okay=False),
              help="kvz calibration bank (default: the bundled gemma-3-270m bank, else one fitted on the calib set).")
@click.option("--calib", multiple=True, help="Calibration caches for KVTC / SZ3-aligned (globs ok; repeatable). "
              "Default: data/calib/*.safetensors if present, else leave-one-out over the inputs.")
@click.option("--eps-points", help="Comma-separated eps sweep (default: 8 log-spaced points, 0.5% .. 10%).")
@click.option("--out", "out", default="out/bench", show_default=True, type=click.Path(file_okay=False),
              help="Output folder (results.json, RESULTS.md, rd.png).")
@click.option("--quick", is_flag=True, help="CI smoke mode: first sample, 256 tokens, every method at FP8's error.")
@click.option("--quality", is_flag=True, help="Also run the rate-quality benchmark (bpv vs downstream KL, top-1, "
              "perplexity on held-out text; needs torch + transformers; --quick: 2 prompts, else 4 documents x 6).")
@click.option("--quality-only", is_flag=True, help="Only run the rate-quality benchmark (OUT/rate_quality.*).")
@click.option("--quality-per-doc", type=int, help="Rate-quality prompts per document (default: the preset's).")
@click.option("--quality-greedy", is_flag=True, help="Also run the older greedy-continuation quality study and "
              "merge it into OUT/results.json (with --quality-only: only that merge).")
@click.option("--quality-prompts", type=int, default=20, show_default=True, help="Prompts of --quality-greedy.")
@click.option("--speed", is_flag=True, help="Also run the speed benchmark (kvz vs SZ3, FP8, zstd, LMCache; kvz 0.1 "
              "side by side; CLI; restore vs prefill) on data/eval into OUT/speed.{json,md,png}; --quick: its quick "
              "preset.")
@click.option("--speed-only", is_flag=True, help="Only run the speed benchmark (CACHES, if given, are its caches).")
@click.option("--methods", help="Comma-separated subset (kvz and baseline names; default: all).")
@click.option("--no-ablation", is_flag=True, help="Skip the codec-switch ablation.")
@click.option("--no-calibration", is_flag=True, help="Skip the auxiliary vs cache-specific bank study.")
@click.option("--self-ranks", default="full,16", show_default=True,
              help="Map ranks of the cache-specific banks in the calibration study (comma-separated; full = no limit).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="BLAS/numba threads (0 = leave as is); 1 times every coder per core.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def bench(caches, bank, calib, eps_points, out, quick, quality, quality_only, quality_per_doc, quality_greedy,
          quality_prompts, speed, speed_only, methods, no_ablation, no_calibration, self_ranks, threads, quiet):
    """Rate-distortion, speed (and downstream quality) of kvz against the baseline coders."""
    from kvz.benchmarks.run import run_bench, run_quality_only

    cmd = _command_line(caches, [("--bank", bank), ("--calib", calib), ("--eps-points", eps_points),
                                 ("--out", out if out != "out/bench" else None), ("--quick", quick),
                                 ("--quality", quality), ("--quality-only", quality_only),
                                 ("--quality-per-doc", quality_per_doc), ("--quality-greedy", quality_greedy),
                                 ("--speed", speed), ("--speed-only", speed_only),
                                 ("--methods", methods), ("--no-ablation", no_ablation),
                                 ("--no-calibration", no_calibration),
                                 ("--self-ranks", self_ranks if self_ranks != "full,16" else None),
                                 ("--threads", threads if threads != 1 else None)])
    if speed_only:
        _speed(out, bank, quick, list(caches), cmd, quiet)
        return
    if quality_only:
        if quality_greedy:
            res = run_quality_only(out, bank=bank, n_prompts=quality_prompts, progress=not quiet)
            click.echo(f"{os.path.join(out, 'RESULTS.md')}: quality merged "
                       f"({len(res['quality'].get('settings', {}))} settings)")
            return
        _rate_quality(out, bank, quick, quality_per_doc, cmd, quiet)
        return
    eps = None
    if eps_points:
        try:
            eps = [float(e) for e in eps_points.split(",") if e.strip()]
        except ValueError:
            raise click.UsageError("--eps-points must be comma-separated numbers") from None
        if not eps or any(not 0 < e < 1 for e in eps):
            raise click.UsageError("--eps-points must lie in (0, 1)")
    calib_paths = []
    for c in calib:
        hits = sorted(glob.glob(c))
        if not hits:
            raise click.UsageError(f"--calib {c}: no such file")
        calib_paths += hits
    for c in caches:
        if not os.path.exists(c):
            raise click.UsageError(f"{c}: no such file")
    try:
        ranks = tuple(None if r.strip() in ("full", "0") else int(r) for r in self_ranks.split(",") if r.strip())
    except ValueError:
        raise click.UsageError("--self-ranks must be comma-separated integers or 'full'") from None
    meth = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    try:
        res = run_bench(list(caches) or None, bank=bank, calib=calib_paths or None, eps_points=eps, out=out,
                        quick=quick, quality=quality and quality_greedy, methods=meth, ablation=not no_ablation,
                        calibration=not no_calibration, self_ranks=ranks, quality_prompts=quality_prompts, command=cmd,
                        progress=not quiet, threads=threads or None)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    t = res["timing"]
    click.echo(f"{out}: {len(res['rows'])} rows, results.json + RESULTS.md + rd.png "
               f"({t['wall_s'] / 60:.1f} min wall, {t['cpu_s'] / 60:.1f} min CPU)")
    if quality:
        _rate_quality(out, bank, quick, quality_per_doc, cmd, quiet)
    if speed:
        _speed(out, bank, quick, None, cmd, quiet)


def _speed(out, bank, quick, caches, cmd, quiet) -> None:
    """The speed benchmark (:mod:`kvz.benchmarks.speed`, a fresh process) into OUT/speed.{json,md,png}."""
    from kvz.benchmarks.run import run_speed

    try:
        res = run_speed(out, quick=quick, bank=bank, caches=caches or None, command=cmd, progress=not quiet)
    except (FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(f"speed: {e}") from None
    bad = [a["point"] for a in res.get("acceptance", []) if not a["met"]]
    click.echo(f"{os.path.join(out, 'speed.json')}: {len(res.get('rows', []))} rows, speed.md + speed.png; "
               f"{len(res.get('acceptance', [])) - len(bad)}/{len(res.get('acceptance', []))} acceptance points met"
               + (f" (not: {'; '.join(bad)})" if bad else ""))


def _rate_quality(out, bank, quick, per_doc, cmd, quiet) -> None:
    """The rate-quality benchmark (:mod:`kvz.benchmarks.rate_quality`) into OUT/rate_quality.{json,md,png}; its
    verdict is appended to OUT/RESULTS.md when that exists."""
    from kvz.benchmarks import rate_quality as RQ

    os.makedirs(out, exist_ok=True)
    js = os.path.join(out, "rate_quality.json")
    try:
        res = RQ.run("quick" if quick else "full", bank=bank or "gemma-3-270m", json_out=js,
                     plot_out=os.path.join(out, "rate_quality.png"), per_doc=per_doc, command=cmd,
                     progress=not quiet)
    except (ImportError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(f"rate-quality: {e}") from None
    lines = RQ.verdict(res["aggregate"])
    md = os.path.join(out, "RESULTS.md")
    if os.path.exists(md):
        with open(md, "a", encoding="utf-8") as f:
            f.write("\n## Rate-quality (downstream KL at a bit budget)\n\n"
                    f"{res['aggregate']['n_prompts']} held-out prompts; full tables in "
                    "[rate_quality.md](rate_quality.md), curves in rate_quality.png.\n\n" + "\n".join(lines) + "\n")
    click.echo(f"{js}: {len(res['rows'])} rows, rate_quality.md + rate_quality.png")
