"""``kvz warmup``: a thin click layer over :func:`alignpred.warmup` (imports only click until it runs)."""
from __future__ import annotations

import json

import click

PROFILE_NAMES = ["default", "balanced", "fast"]  # alignpred.codec.profiles.PROFILES (not imported: start-up)


@click.command("warmup")
@click.option("--profile", "profiles", multiple=True, type=click.Choice(PROFILE_NAMES),
              help="Speed profile to warm (repeatable)  [default: all three]")
@click.option("--lossless/--no-lossless", default=True, show_default=True,
              help="Also warm each profile with the lossless tier.")
@click.option("--bank", help="Bank (path, registry name or content id)  [default: the bundled gemma-3-270m]")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="dtype of the served caches (repeatable)  [default: bfloat16]")
@click.option("--tokens", type=click.IntRange(min=2), default=None,
              help="Positions of the synthetic cache  [default: alignpred.api.warmup.WARM_TOKENS]")
@click.option("--eps", type=float, default=0.02, show_default=True, help="Error bound of the lossy modes.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Worker threads.")
@click.option("--full", is_flag=True, help="Compress and read in every mode even where an earlier warm-up's "
              "manifest would only load the kernels.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def warmup(profiles, lossless, bank, dtypes, tokens, eps, threads, full, as_json):
    """Compile kvz's numba kernels (or load them from numba's on-disk cache) for the given modes, so
    that no later process or request compiles: run once at install time as the user that serves
    (numba caches next to the installed sources, else in $NUMBA_CACHE_DIR, else ~/.cache/numba).
    Prints the seconds of every step and whether anything compiled."""
    from kvz.cli.startup import skip_numba_blas_probe

    skip_numba_blas_probe()  # as every kvz command that runs kernels (the compiled kernels are the same)
    from alignpred import KvzError
    from alignpred import warmup as run_warmup

    shape = None
    if tokens is not None:
        from alignpred import resolve_bank

        try:
            sig = resolve_bank(bank or "gemma-3-270m").signature
        except KvzError as e:
            raise click.ClickException(str(e)) from None
        shape = (sig["num_layers"], sig["kv_heads"], tokens, sig["head_dim"])

    def show(step):
        if not as_json:
            click.echo(f"  {step['step']}: compress {step['compress_s']:.2f} s, read {step['read_s']:.2f} s"
                       + (f", {step['compiled']} kernels compiled" if step["compiled"] else ""))

    try:
        res = run_warmup(tuple(profiles) or tuple(PROFILE_NAMES), lossless, bank=bank, shape=shape,
                         dtype=tuple(dtypes) or "bfloat16", eps=eps, threads=threads, full=full,
                         progress=show)
    except KvzError as e:
        raise click.ClickException(str(e)) from None
    for w in res["warnings"]:
        click.echo(f"Warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(res, indent=2, sort_keys=True))
        return
    if res["how"] == "loaded":
        load = next(s for s in res["steps"] if s["step"] == "load")
        click.echo(f"  loaded {load['kernels']} kernel versions listed by an earlier warm-up: {load['seconds']:.2f} s")
    what = (f"{res['compile_count']} kernels compiled" if res["compile_count"] else "nothing compiled") + \
        f", {res['cache_loads']} loaded from numba's cache"
    click.echo(f"warm-up {res['total_s']:.2f} s ({what}); cache: {', '.join(res['cache_dirs']) or 'none'}")
