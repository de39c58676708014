"""The ``kvz`` command line: a thin layer over :mod:`alignpred`.

Every command maps the library's errors to a one-line message and exit status 2.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import click

from alignpred import Bank, CodecConfig, KvzError, KvzReader, compress as compress_cache, fit_bank, load_cache


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


def _progress(total: int | None, desc: str, quiet: bool, unit: str = "tensor"):
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
@click.version_option(package_name="kvz")
def cli():
    """kvz: error-bounded KV-cache compression (AlignPred) and the .kvz container."""


@cli.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Output .kvz (default: SRC with .kvz).")
@click.option("--eps", type=float, default=0.03, show_default=True, help="Relative Frobenius error bound (NRMSE).")
@click.option("--eps-scope", type=click.Choice(["object", "tensor", "pooled"]), default="tensor", show_default=True,
              help="Unit that must meet eps: each 256-token object, each tensor, or the whole cache.")
@click.option("--bank", type=click.Path(dir_okay=False), help="Calibration bank (.h5) fitted on other caches.")
@click.option("--self-calibrate", is_flag=True, help="Fit a bank on this cache and embed it (counted in bpv).")
@click.option("--rank", type=int, default=16, show_default=True, help="Map rank for --self-calibrate (0 = full).")
@click.option("--align/--no-align", default=False, show_default=True, help="Code in the GPA-aligned frame.")
@click.option("--no-map", is_flag=True, help="Ablation: disable the linear-map inter-block predictor.")
@click.option("--blend", is_flag=True, help="Allow the paper's lambda-blended aligned predictor.")
@click.option("--no-intra", is_flag=True, help="Ablation: disable token interpolation.")
@click.option("--no-channel-choice", is_flag=True, help="Ablation: one predictor per block, not per channel.")
@click.option("--no-rope-undo", is_flag=True, help="Ablation: code keys with RoPE applied.")
@click.option("--sink-tokens", type=int, default=1, show_default=True,
              help="Leading positions (attention sink) coded with a 16x finer step; 0 disables.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_errors
def compress(src, out, eps, eps_scope, bank, self_calibrate, rank, align, no_map, blend, no_intra,
             no_channel_choice, no_rope_undo, sink_tokens, as_json, quiet):
    """Compress a KV cache (safetensors) into a .kvz file."""
    out = out or os.path.splitext(src)[0] + ".kvz"
    cache = load_cache(src)
    if self_calibrate == bool(bank):
        raise click.UsageError("give exactly one of --bank BANK or --self-calibrate")
    b = fit_bank([cache], rank=rank or None, rotations=align) if self_calibrate else Bank.load(bank)
    cfg = CodecConfig(align=align, inter_map=not no_map, blend=blend, intra=not no_intra,
                      channel_choice=not no_channel_choice, rope_undo=not no_rope_undo, sink_tokens=max(0, sink_tokens))
    # The step search makes several whole-cache passes (their number is not known in advance):
    # the bar counts positions coded over all passes.
    with _progress(None, "compress", quiet, unit="pos") as bar:
        info = compress_cache(cache, out, eps=eps, bank=b, scope=eps_scope, config=cfg, embed_bank=self_calibrate,
                              progress=bar.update)
    res = {"input": src, "output": out, "eps": eps, "eps_scope": eps_scope, "bpv": info.bpv,
           "file_bytes": info.file_bytes, "bank_bytes": info.bank_bytes, "n_values": info.n_values,
           "nrmse_pooled": info.nrmse_pooled, "nrmse_max_tensor": info.nrmse_max_tensor, "bank_id": b.id}
    src_bits = 32 if cache.layout.dtype == "float32" else 16
    _emit(res, as_json, [f"{out}: {info.file_bytes} bytes, {info.bpv:.3f} bits/value "
                         f"({src_bits / info.bpv:.2f}x smaller than the {cache.layout.dtype} input)",
                         f"error: pooled NRMSE {info.nrmse_pooled:.6f}, worst tensor {info.nrmse_max_tensor:.6f} "
                         f"(eps {eps}, scope {eps_scope})"])


@cli.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Output safetensors.")
@click.option("--bank", type=click.Path(dir_okay=False), help="Bank the file was written with (if not embedded).")
@click.option("--tokens", help="Token range A:B to decode (default: all).")
@click.option("--layers", type=int, help="Decode only the first N layers.")
@click.option("--json", "as_json", is_flag=True)
@click.option("-q", "--quiet", is_flag=True)
@_errors
def decompress(src, out, bank, tokens, layers, as_json, quiet):
    """Decode a .kvz file back to safetensors (same names, shapes and dtypes).

    Streams in bounded memory: 256 positions of every layer at a time, each slice written at its
    place in a temporary file that is renamed over OUT at the end."""
    out = out or os.path.splitext(src)[0] + ".safetensors"
    r = KvzReader(src, bank=bank)
    lay = r.layout
    rng = None
    if tokens:
        try:
            a, b = (int(v) for v in tokens.split(":"))
        except ValueError:
            raise click.UsageError("--tokens must look like A:B") from None
        if not (0 <= a < b <= lay.n_tokens):
            raise click.UsageError(f"--tokens {a}:{b} is outside 0:{lay.n_tokens}")
        rng = (a, b)
    if layers is not None and not (1 <= layers <= lay.num_layers):
        raise click.UsageError(f"--layers must be in 1..{lay.num_layers}")
    n_layers = layers or lay.num_layers
    _ = r.decoder  # resolve the bank (and fail on a wrong one) before creating the output
    a, b = rng or (0, lay.n_tokens)
    with _progress(b - a, "decompress", quiet, unit="pos") as bar:
        r.decompress_to(out, rng, n_layers, progress=bar.update)
    specs = lay.tensor_names()[:2 * n_layers]
    _emit({"input": src, "output": out, "tensors": len(specs)}, as_json, [f"{out}: {len(specs)} tensors"])


@cli.command()
@click.argument("caches", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Output bank (.h5).")
@click.option("--rank", type=int, default=0, show_default=True,
              help="Rank of the prediction maps (0 = full; measured best: rank 128 costs +0.2 bpv).")
@click.option("--depth", type=int, default=1, show_default=True,
              help="Layers back the maps look (2 saves ~0.07 bpv, costs a larger bank and slower decode).")
@click.option("--group-size", type=int, default=3, show_default=True, help="Neighbouring layers per GPA group.")
@click.option("--no-rotations", is_flag=True, help="Skip GPA rotations (smaller bank; no --align).")
@click.option("--eps-cal", type=float, default=0.03, show_default=True,
              help="Relative noise the maps are made robust to (the typical eps).")
@click.option("--json", "as_json", is_flag=True)
@_errors
def calibrate(caches, out, rank, depth, group_size, no_rotations, eps_cal, as_json):
    """Fit a calibration bank (GPA rotations and prediction maps) on caches of one model."""
    loaded = [load_cache(c) for c in caches]
    bank = fit_bank(loaded, rank=rank or None, depth=depth, group_size=group_size, rotations=not no_rotations,
                    eps_cal=eps_cal)
    bank.save(out)
    size = os.path.getsize(out)
    _emit({"output": out, "bank_id": bank.id, "bytes": size, "positions": bank.config["n_positions"]}, as_json,
          [f"{out}: bank {bank.id[:23]}… ({size} bytes, {bank.config['n_positions']} positions per block)"])


@cli.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@_errors
def inspect(src, as_json):
    """Show layout, bits per value and achieved error per tensor, and the bank id."""
    s = KvzReader(src).summary()
    lay = s["layout"]
    lines = [f"{s['file']}: kvz {s['version']}, {lay['model'] or 'unknown model'}, {lay['num_layers']} layers x "
             f"{lay['kv_heads']} KV heads x {lay['n_tokens']} tokens x {lay['head_dim']} ({lay['dtype']})",
             f"{s['file_bytes']} bytes, {s['bpv']:.3f} bits/value; eps {s['eps']} ({s['eps_scope']}); "
             f"pooled NRMSE {s['nrmse_pooled']:.6f}, worst tensor {s['nrmse_max_tensor']:.6f}",
             f"bank {s['bank_id']}{' (embedded, %d bytes)' % s['bank_bytes'] if s['bank_embedded'] else ''}",
             f"{'tensor':<20} {'nrmse':>9} {'bpv':>7} {'worst object':>13}"]
    for name, t in s["tensors"].items():
        lines.append(f"{name:<20} {t['nrmse']:9.6f} {t['bpv_payload']:7.3f} {t['max_object_nrmse']:13.6f}")
    _emit(s, as_json, lines)


def _register_optional():
    try:
        from cli.capture_cmd import capture
        cli.add_command(capture)
    except ImportError:
        pass
    try:
        from cli.bench_cmd import bench
        cli.add_command(bench)
    except ImportError:
        pass


_register_optional()


def main():
    cli(prog_name="kvz")


if __name__ == "__main__":
    main()
