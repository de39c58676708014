"""The ``kvz`` command line: a thin layer over :mod:`alignpred`.

Every command maps the library's errors to a one-line message and exit status 2.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import warnings

import click

# Only the light part of kvz at import time (``kvz --help`` must start in well under 0.15 s): every
# command imports the library it uses when it runs.
from alignpred.errors import KvzError
from kvz import __version__
from kvz.cli.calibrate_cmd import model_options as _calibrate_model_options  # imports only click
from kvz.cli.outputs import check_output as _check_output
from kvz.cli.outputs import decompress_outputs as _decompress_outputs
from kvz.cli.startup import NoBar, StartupClock, announce_compiles, exit_process, skip_numba_blas_probe  # noqa: F401
from kvz.cli.store_cmd import store as _store_cmd  # imports only click
from kvz.cli.warmup_cmd import warmup as _warmup_cmd  # imports only click

PROFILE_NAMES = ["default", "balanced", "fast"]  # alignpred.codec.profiles.PROFILES (not imported: start-up)


def _errors(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        try:
            return fn(*a, **k)
        except KvzError as e:
            raise click.ClickException(str(e)) from None
        except BrokenPipeError:  # output piped into `head` and friends: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except OSError as e:
            raise click.ClickException(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}".lstrip(": ")) from None
        except MemoryError:
            raise click.ClickException("out of memory") from None
    return wrapper


def _show_warning(message, category, filename, lineno, file=None, line=None):
    click.echo(f"Warning: {message}", err=True)


def _progress(total: int | None, desc: str, quiet: bool, unit: str = "tensor"):
    # tqdm (0.02-0.04 s to import) only where it shows a bar: its disable=None hides the bar when
    # stderr is not a terminal, the test below
    if quiet or (hasattr(sys.stderr, "isatty") and not sys.stderr.isatty()):
        return NoBar()
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, disable=quiet or None,
               leave=False)
    return bar


def _emit(obj: dict, as_json: bool, lines: list[str]):
    if as_json:
        click.echo(json.dumps(obj, indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__)  # (not package_name: importlib.metadata costs 0.02-0.05 s)
def cli():
    """kvz: error-bounded KV-cache compression (AlignPred) and the .kvz container."""


def _kl_option(value):
    """``--target-kl``: a positive number or ``fp8`` (the KL FP8 e4m3 reaches), as a float."""
    if value is None:
        return None
    from alignpred.codec import named_kl

    try:
        return named_kl(value)
    except KvzError as e:
        raise click.BadParameter(str(e)) from None


@cli.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Output .kvz (default: SRC with .kvz).")
@click.option("--eps", type=float, default=None, help="Relative Frobenius error bound (NRMSE)  [default: 0.03]")
@click.option("--eps-scope", type=click.Choice(["object", "tensor", "pooled", "weighted", "attention"]),
              default=None,
              help="[default: tensor; with --target-kl: attention if the bank has attention statistics, else "
                   "weighted] Unit that must meet eps: each 256-token object, each tensor, the whole cache, "
                   "the whole cache with each tensor weighted by its measured effect on the model's output "
                   "(weighted: the bank's sensitivity record), or that plus the error of every channel and "
                   "position weighted by what attention reads of it (attention, format 1.3: the bank's attention "
                   "statistics; positions a sliding-window layer never attends again are coded coarsely, so read "
                   "such a file to continue after its last position, not as a shorter prefix).")
@click.option("--target-kl", default=None, callback=lambda ctx, p, v: _kl_option(v), metavar="KL|fp8",
              help="Ask for a mean next-token KL divergence instead of an NRMSE: a number, or 'fp8' (FP8 e4m3's KL, "
                   "as the engines' default) (the attention scope when the bank has attention statistics, else "
                   "weighted; needs the bank's sensitivity record).")
@click.option("--bank", type=click.Path(dir_okay=False), help="Calibration bank (.h5) fitted on other caches.")
@click.option("--self-calibrate", is_flag=True, help="Fit a bank on this cache and embed it (counted in bpv).")
@click.option("--rank", type=int, default=16, show_default=True, help="Map rank for --self-calibrate (0 = full).")
@click.option("--align/--no-align", default=False, show_default=True, help="Code in the GPA-aligned frame.")
@click.option("--profile", type=click.Choice(PROFILE_NAMES), default="default", show_default=True,
              help="Size/decode-speed trade-off: default (fewest bits), balanced (SIMD entropy decoder, ~+0.05 "
                   "bit/value), fast (also no linear maps: ~+0.8 bit/value, ~3x faster decode).")
@click.option("--no-map", is_flag=True, help="Ablation: disable the linear-map inter-block predictor.")
@click.option("--blend", is_flag=True, help="Allow the paper's lambda-blended aligned predictor.")
@click.option("--no-intra", is_flag=True, help="Ablation: disable token interpolation.")
@click.option("--no-channel-choice", is_flag=True, help="Ablation: one predictor per block, not per channel.")
@click.option("--no-rope-undo", is_flag=True, help="Ablation: code keys with RoPE applied.")
@click.option("--sink-tokens", type=click.IntRange(min=0), default=1, show_default=True,
              help="First positions of the sequence (attention sink) coded with a 16x finer step; 0 disables.")
@click.option("--tensor-cap", type=float, default=None,
              help="Pooled and weighted scopes: cap every tensor's NRMSE at this multiple of eps (0 = no cap)  "
                   "[default: alignpred.codec.budget.TENSOR_CAP, 3]")
@click.option("--plain-cap", type=float, default=None,
              help="Attention scope: cap every tensor's plain NRMSE over the positions a later query reads (0 = no "
                   "cap)  [default: alignpred.codec.budget.PLAIN_CAP, 0.5]")
@click.option("--lossless", is_flag=True,
              help="Add a refinement tier: the file decodes to the original bits; its coarse tier (at --eps) stays "
                   "readable alone (decompress --tier coarse).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Worker threads (default: the cores available; the file does not depend on it).")
@click.option("--trust-rope", is_flag=True,
              help="Skip the check of the metadata's RoPE against the keys (a wrong base is an error otherwise).")
@click.option("-f", "--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_errors
def compress(src, out, eps, eps_scope, target_kl, bank, self_calibrate, rank, align, profile, no_map, blend,
             no_intra, no_channel_choice, no_rope_undo, sink_tokens, tensor_cap, plain_cap, lossless, trust_rope,
             threads, force, as_json, quiet):
    """Compress a KV cache (safetensors) into a .kvz file.

    BANK is a bank file, a registered bank's name (see `kvz bank list`; e.g. gemma-3-270m) or
    its content id."""
    skip_numba_blas_probe()
    announce_compiles()  # one line on stderr if kernels compile (numba's cache empty)
    from alignpred import CodecConfig, ErrorBudget, compress, fit_bank, load_cache
    from alignpred.bank import fitting, resolve_bank
    from alignpred.codec import DEFAULT_EPS, scope_of
    from alignpred.codec import profile as profile_named

    out = out or os.path.splitext(src)[0] + ".kvz"
    if target_kl is not None and eps is not None:
        raise click.UsageError("give --eps or --target-kl, not both")
    if self_calibrate and bank:
        raise click.UsageError("give one of --bank BANK or --self-calibrate, not both")
    # The budget is checked before the input is read: a bad --eps is one line, at once.
    budget = ErrorBudget.from_options(eps=DEFAULT_EPS if eps is None and target_kl is None else eps, scope=eps_scope,
                                      tensor_cap=tensor_cap, target_kl=target_kl, plain_cap=plain_cap,
                                      lossless=lossless)
    prof = profile_named(profile or "default", embed_bank=self_calibrate, trust_rope=trust_rope)
    cache = load_cache(src)  # a bad input is reported before the output is looked at
    _check_output(out, force, [src])
    if self_calibrate:
        b = fit_bank([cache], rank=rank or None, rotations=align)
    elif bank:
        b = resolve_bank(bank, cache.layout)
    else:
        es = fitting(cache.layout)
        hint = f" (the {es[0].origin} bank {es[0].name} fits this cache: --bank {es[0].name})" if es else ""
        raise click.UsageError(f"give --bank BANK{hint} or --self-calibrate")
    cfg = CodecConfig(align=align, inter_map=not no_map, blend=blend, intra=not no_intra,
                      channel_choice=not no_channel_choice, rope_undo=not no_rope_undo, sink_tokens=sink_tokens)
    # The step search makes several whole-cache passes (their number is not known in advance):
    # the bar counts positions coded over all passes.
    with _progress(None, "compress", quiet, unit="pos") as bar:
        info = compress(cache, out, budget=budget, bank=b, profile=prof, config=cfg, threads=threads,
                        progress=bar.update)
    eps, eps_scope = info.eps, info.scope
    b_id = info.bank_id
    res = {"input": src, "output": out, "eps": eps, "eps_scope": eps_scope, "profile": profile, "lossless": lossless,
           "bpv": info.bpv,
           "file_bytes": info.file_bytes, "bank_bytes": info.bank_bytes, "n_values": info.n_values,
           "nrmse_pooled": info.nrmse_pooled, "nrmse_max_tensor": info.nrmse_max_tensor, "bank_id": b_id,
           "nrmse_weighted": info.nrmse_weighted, "kl_predicted": info.kl_predicted, "target_kl": target_kl}
    src_bits = 32 if cache.layout.dtype == "float32" else 16
    cap_note = f", tensor cap {budget.cap:g} x eps" if budget.cap else ""
    weighted_note = (f"; weighted NRMSE {info.nrmse_weighted:.6f}, predicted KL {info.kl_predicted:.2e}"
                     if info.nrmse_weighted is not None else "")
    _emit(res, as_json, [f"{out}: {info.file_bytes} bytes, {info.bpv:.3f} bits/value "
                         f"({src_bits / info.bpv:.2f}x smaller than the {cache.layout.dtype} input)",
                         f"error{' (attention-weighted measure)' if scope_of(eps_scope).attention else ''}: "
                         "pooled NRMSE "
                         f"{info.nrmse_pooled:.6f}, worst tensor {info.nrmse_max_tensor:.6f} "
                         f"(eps {eps:.6g}, scope {eps_scope}"
                         f"{cap_note})"
                         f"{weighted_note}"
                         f"{'; the exact tier decodes to the original bits' if lossless else ''}"])


@cli.command()
@click.argument("srcs", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="SRC...")
@click.option("-o", "--output", "out", type=click.Path(),
              help="Output safetensors (one SRC), or an existing directory (several).")
@click.option("--bank", type=click.Path(dir_okay=False), help="Bank the files were written with (if not embedded).")
@click.option("--tokens", help="Token range A:B to decode (default: all).")
@click.option("--layers", type=int, help="Decode only the first N layers.")
@click.option("--tier", type=click.Choice(["coarse", "exact"]),
              help="Tier of a --lossless file (default: the best it has).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Decode threads (default: the cores available; the output does not depend on it).")
@click.option("-f", "--force", is_flag=True, help="Replace outputs that exist.")
@click.option("--json", "as_json", is_flag=True)
@click.option("-q", "--quiet", is_flag=True)
@click.option("-v", "--verbose", is_flag=True, help="Report the start-up and decode times on stderr.")
@_errors
def decompress(srcs, out, bank, tokens, layers, tier, threads, force, as_json, quiet, verbose):
    """Decode .kvz files back to safetensors (same names, shapes and dtypes).

    One SRC: OUT defaults to SRC with .safetensors. Several: each goes to its name with
    .safetensors in OUT (a directory) or next to its SRC; one process decodes them all, so the
    start-up (Python, numba, the bank) is paid once. Existing outputs (the original caches,
    typically) are never replaced without --force, and every output is checked before anything is
    decoded. Streams in bounded memory: 2,048 positions of every layer at a time (decoded on all
    threads), each slice written at its place in a temporary file renamed over the output at the
    end."""
    clock = StartupClock()
    skip_numba_blas_probe()
    clock.watch = announce_compiles()  # one line on stderr if kernels compile (numba's cache empty)
    from alignpred import KvzReader

    clock.mark("imports")
    outs = _decompress_outputs(srcs, out)
    rng = None
    if tokens:
        try:
            rng = tuple(int(v) for v in tokens.split(":"))
            if len(rng) != 2:
                raise ValueError
        except ValueError:
            raise click.UsageError("--tokens must look like A:B") from None
    readers = []
    for src, dst in zip(srcs, outs):
        r = KvzReader(src, bank=bank, threads=threads)
        _check_output(dst, force, srcs)
        lay = r.layout
        if rng and not (0 <= rng[0] < rng[1] <= lay.n_tokens):
            raise click.UsageError(f"--tokens {rng[0]}:{rng[1]}: need 0 <= A < B <= {lay.n_tokens}"
                                   + (f" ({src})" if len(srcs) > 1 else ""))
        if layers is not None and not (1 <= layers <= lay.num_layers):
            raise click.UsageError(f"--layers must be in 1..{lay.num_layers}" + (f" ({src})" if len(srcs) > 1 else ""))
        readers.append(r)
    clock.mark("open")
    done = []
    for src, dst, r in zip(srcs, outs, readers):
        lay = r.layout
        n_layers = layers or lay.num_layers
        _ = r.decoder  # resolve the bank (and fail on a wrong one) before creating the output
        clock.mark("bank")
        a, b = rng or (0, lay.n_tokens)
        with _progress(b - a, f"decompress {os.path.basename(src)}" if len(srcs) > 1 else "decompress", quiet,
                       unit="pos") as bar:
            r.decompress_to(dst, rng, n_layers, progress=bar.update, tier=tier)
        done.append({"input": src, "output": dst, "tensors": 2 * n_layers})
        if len(srcs) > 1 and not as_json:  # as each file is finished (-q only hides progress bars)
            click.echo(f"{dst}: {2 * n_layers} tensors")
    if len(srcs) == 1:
        _emit(done[0], as_json, [f"{done[0]['output']}: {done[0]['tensors']} tensors"])
    elif as_json:
        _emit({"files": done}, True, [])
    if verbose:
        click.echo(f"kvz decompress: {clock.report()}", err=True)


@cli.command()
@click.argument("caches", nargs=-1, required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Output bank (.h5).")
@click.option("--rank", type=int, default=0, show_default=True,
              help="Rank of the prediction maps (0 = full; measured best: rank 128 costs +0.2 bpv).")
@click.option("--depth", type=int, default=1, show_default=True,
              help="Layers back the maps look (2 saves ~0.07 bpv, costs a larger bank and slower decode).")
@click.option("--group-size", type=int, default=3, show_default=True, help="Neighbouring layers per GPA group.")
@click.option("--no-rotations", is_flag=True, help="Skip GPA rotations (smaller bank; no --align).")
@click.option("--eps-cal", type=float, default=0.03, show_default=True,
              help="Relative noise the maps are made robust to (the typical eps).")
@click.option("-f", "--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True)
@_calibrate_model_options
@_errors
def calibrate(caches, out, rank, depth, group_size, no_rotations, eps_cal, force, as_json, model_path, texts, tokens,
              register_name, sensitivity, model_id, quiet):
    """Fit a calibration bank (GPA rotations and prediction maps) on caches of one model — or, with
    --model M --texts DIR, on your own model: capture its KV on the texts, fit, measure the
    sensitivity record (--target-kl) and register the bank, with progress (-q: none)."""
    if model_path:
        if caches:
            raise click.UsageError("give CACHES... or --model M --texts DIR, not both")
        from kvz.cli.calibrate_cmd import calibrate_model

        calibrate_model(model_path=model_path, texts=texts, out=out, tokens=tokens, register_name=register_name,
                        sensitivity=sensitivity, model_id=model_id, quiet=quiet, force=force, rank=rank, depth=depth,
                        group_size=group_size, no_rotations=no_rotations, eps_cal=eps_cal, as_json=as_json)
        return
    if not caches:
        raise click.UsageError("give CACHES... (kvz cache files) or --model M --texts DIR")
    if texts or tokens or register_name or model_id:
        raise click.UsageError("--texts, --tokens, --register and --model-id go with --model")
    skip_numba_blas_probe()
    from alignpred import fit_bank, load_cache
    from kvz.cli.calibrate_cmd import capture_records, write_attention_sidecar

    _check_output(out, force, caches)
    loaded = [load_cache(c) for c in caches]
    records = capture_records(loaded, out, force)  # kvz capture --attention-stats: the bank's attention statistics
    bank = fit_bank(loaded, rank=rank or None, depth=depth, group_size=group_size, rotations=not no_rotations,
                    eps_cal=eps_cal)
    bank.save(out)
    side, side_lines = write_attention_sidecar(records, bank, out)
    size = os.path.getsize(out)
    _emit({"output": out, "bank_id": bank.id, "bytes": size, "positions": bank.config["n_positions"],
           "attention_stats": side}, as_json,
          [f"{out}: bank {bank.id[:23]}… ({size} bytes, {bank.config['n_positions']} positions per block)"]
          + side_lines)


@cli.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@click.option("--verify", "check", is_flag=True, help="Also check every payload checksum (kvz verify decodes too).")
@_errors
def inspect(src, as_json, check):
    """Show layout, bits per value and achieved error per tensor, and the bank id."""
    from alignpred import KvzReader

    r = KvzReader(src)
    if check:
        r.verify()
    s = r.summary()
    lay = s["layout"]
    cap = f", tensor cap {s['tensor_cap']:g} x eps" if s["tensor_cap"] else ""
    lines = [f"{s['file']}: kvz {s['version']}, {lay['model'] or 'unknown model'}, {lay['num_layers']} layers x "
             f"{lay['kv_heads']} KV heads x {lay['n_tokens']} tokens x {lay['head_dim']} ({lay['dtype']})",
             f"{s['file_bytes']} bytes, {s['bpv']:.3f} bits/value; eps {s['eps']} ({s['eps_scope']}{cap}); "
             f"pooled NRMSE {s['nrmse_pooled']:.6f}, worst tensor {s['nrmse_max_tensor']:.6f}",
             f"bank {s['bank_id']}" + (f" (embedded, {s['bank_bytes']} bytes)" if s['bank_embedded'] else ""),
             "tiers: " + ", ".join(f"{t} {8 * s['tier_payload_bytes'][t] / s['n_values']:.3f} bpv"
                                   for t in s["tiers"]) + f"; entropy coder {s['coder']}, linear maps "
             f"{'on' if s['config'].get('inter_map', True) else 'off'}",
             f"{'tensor':<20} {'nrmse':>9} {'bpv':>7} {'worst object':>13}"]
    plain = s["error_measure"] == "attention" and all("plain_nrmse_read" in t for t in s["tensors"].values())
    if plain:
        lines[-1] += f" {'plain (read)':>13}"
    if s["error_measure"] == "attention":
        cfg = s["config"]
        stale = (f"; in sliding-window layers, positions before the last {cfg['stale_window'] - 1} at step x "
                 f"{cfg['stale_scale']:g} (never attended again)" if cfg.get("stale_window") else "")
        lines.insert(-1, "error measure: attention-weighted (every value's error and norm weighted by 1 / its step "
                         f"multiplier squared: channels by the bank's query and W_o statistics{stale}); the NRMSE "
                         "columns are in that measure" + (f"; plain (read): the plain NRMSE over the positions a later "
                                                         f"query reads, capped at {s['plain_cap']:g}" if plain else ""))
    for name, t in s["tensors"].items():
        lines.append(f"{name:<20} {t['nrmse']:9.6f} {t['bpv_payload']:7.3f} {t['max_object_nrmse']:13.6f}"
                     + (f" {t['plain_nrmse_read']:13.6f}" if plain else ""))
    _emit(s, as_json, lines)


@cli.group()
def bank():
    """The bank registry: list, add and show calibration banks (found by id or name)."""


@bank.command("list")
@click.option("--json", "as_json", is_flag=True)
@_errors
def bank_list(as_json):
    """Registered banks, in lookup order ($KVZ_BANK_PATH, the user folder, the bundled ones)."""
    from alignpred.bank import registry, search_dirs

    es = registry()
    rows = [{"name": e.name, "id": e.id, "model": e.model, "signature": e.signature, "origin": e.origin,
             "path": e.path, "attention_stats": e.has_attention_stats} for e in es]
    lines = [f"{'name':<28} {'id':<21} {'model':<16} {'layers x heads x dim':<20} origin"]
    for e in es:
        sig = e.signature
        lines.append(f"{e.name:<28} {e.id[:19] + '…':<21} {e.model or '-':<16} "
                     f"{'{} x {} x {}'.format(sig.get('num_layers'), sig.get('kv_heads'), sig.get('head_dim')):<20} "
                     f"{e.origin}")
    with_stats = [e.name for e in es if e.has_attention_stats]
    if with_stats:
        lines.append("with attention statistics: " + ", ".join(with_stats))
    if not es:
        lines = ["no banks registered; searched: " + ", ".join(str(d) for _, d in search_dirs())]
    _emit({"banks": rows}, as_json, lines)


@bank.command("add")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--name", help="Registry name (default: model and id prefix).")
@click.option("-f", "--force", is_flag=True, help="Replace a registered bank of the same name.")
@click.option("--json", "as_json", is_flag=True)
@_errors
def bank_add(path, name, force, as_json):
    """Verify a bank file and copy it into the user bank folder."""
    from alignpred.bank import add

    e = add(path, name, force)
    _emit({"name": e.name, "id": e.id, "path": e.path}, as_json, [f"{e.name}: {e.id} -> {e.path}"])


@cli.command()
@click.argument("srcs", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="FILE...")
@click.option("--bank", type=click.Path(dir_okay=False), help="Bank the files were written with (if not embedded).")
@click.option("--no-decode", is_flag=True, help="Check every checksum only (no decode).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Decode threads.")
@click.option("--json", "as_json", is_flag=True)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_errors
def verify(srcs, bank, no_decode, threads, as_json, quiet):
    """Check .kvz files: every checksum (preamble, header, index, payloads, embedded bank), then
    decode every tier of every object. Exits non-zero on the first fault, naming it."""
    skip_numba_blas_probe()
    from alignpred import KvzReader

    rows = []
    for src in srcs:
        r = KvzReader(src, bank=bank, threads=threads)  # preamble, header and index checked on open
        checked = r.verify()
        tiers = [] if no_decode else list(r.tiers)
        with _progress(len(tiers) * len(r.metas), f"verify {os.path.basename(src)}", quiet) as bar:
            for tier in tiers:
                for _ in r.iter_layers(tier=tier):
                    bar.update(1)
        rows.append({"file": src, "bytes_checked": checked, "tiers_decoded": tiers})
        line = f"{src}: ok ({checked} payload bytes checked" + (f"; decoded {', '.join(tiers)})" if tiers else ")")
        if not as_json:
            click.echo(line)
    if as_json:
        click.echo(json.dumps({"files": rows}, indent=2, sort_keys=True))


@bank.command("show")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True)
@_errors
def bank_show(ref, as_json):
    """Details of a bank (REF: a path, a registry name or a content id)."""
    from alignpred.bank import AttentionStats, AttentionStatsError, resolve_bank

    b = resolve_bank(ref)
    try:
        att, att_line = AttentionStats.find(ref), ""
    except AttentionStatsError as e:  # the bank itself is fine: say what is wrong with its sidecar
        att, att_line = None, f"unreadable ({e})"
    cfg = b.config
    maps = sorted({n.split("/")[1] for n in b.arrays if n.startswith("map/")})
    info = {"id": b.id, "model": b.model, "signature": b.signature, "bytes": b.nbytes, "arrays": len(b.arrays),
            "groups": len(cfg.get("groups", [])), "blocks_with_maps": len(maps), "rank": cfg.get("rank"),
            "eps_cal": cfg.get("eps_cal"), "n_positions": cfg.get("n_positions"),
            "rope_undone": cfg.get("rope_undone"), "rotations": any(n.startswith("rot/") for n in b.arrays),
            "attention_stats": att is not None}
    lines = [f"bank {b.id}", f"model {b.model or '-'}; {b.signature}",
             f"{info['bytes']} bytes, {info['arrays']} arrays; {info['blocks_with_maps']} blocks with maps "
             f"(rank {info['rank'] or 'full'}, eps_cal {info['eps_cal']}); {info['groups']} GPA groups"
             f"{'' if info['rotations'] else ' (no rotations)'}; fitted on {info['n_positions']} positions per block; "
             f"RoPE undone on keys: {info['rope_undone']}",
             "attention statistics: " + (f"{att.num_layers} layers x {att.kv_heads} KV heads (beside the bank)"
                                         if att is not None else att_line or "none (kvz calibrate on captures made "
                                                                             "with kvz capture --attention-stats)")]
    _emit(info, as_json, lines)


def _register_optional():
    try:
        from kvz.cli.capture_cmd import capture
        cli.add_command(capture)
    except ImportError:
        pass
    try:
        from kvz.cli.bench_cmd import bench
        cli.add_command(bench)
    except ImportError:
        pass


_register_optional()
cli.add_command(_warmup_cmd)
cli.add_command(_store_cmd)


def main():
    warnings.showwarning = _show_warning  # one line on stderr, no source line
    try:
        cli(prog_name="kvz")
    except SystemExit as e:
        exit_process(e.code)


if __name__ == "__main__":
    main()
