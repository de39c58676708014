"""``kvz calibrate --model M --texts DIR -o bank.h5``: bring your own model in one command.

Captures the model's K/V on the texts (transformers on the CPU, exact RoPE metadata, as ``kvz capture``),
fits a bank, measures its per-tensor KL sensitivity (so ``--target-kl`` and ``--eps-scope weighted`` work
with it) and, with ``--register NAME``, adds both to the bank registry. Progress goes to stderr (``-q``:
none). The bank's model id is the model's name, never a local path.

``kvz calibrate CACHES... -o bank.h5`` (a fit from cache files) is ``cli/main.py``'s; this module gives it
the ``--model`` option set (:func:`model_options`) and the implementation (:func:`calibrate_model`).
torch / transformers are imported only when the command runs.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

_HINT = "install the model extra: pip install -e '.[model]'"

__all__ = ["model_options", "calibrate_model", "calibrate_model_command", "load_for_cli", "capture_records",
           "write_attention_sidecar"]

_OPTIONS = [
    click.option("--model", "model_path", default=None, type=click.Path(exists=False),
                 help="Calibrate from a model instead of caches: a Hugging Face model directory or a .gguf file "
                      "(CPU, float32, offline)."),
    click.option("--texts", "texts", default=None, type=click.Path(exists=False),
                 help="With --model: a folder of UTF-8 .txt calibration texts (or one text file)."),
    click.option("--tokens", "-n", "tokens", type=click.IntRange(min=2), default=None,
                 help="With --model: keep the first N tokens of each text, BOS included (default: all). "
                      "Measured on SmolLM2-135M: 4 texts x 1,024 tokens is within 0.03 bpv of 4 x 2,048 "
                      "(docs/own-model.md)."),
    click.option("--register", "register_name", default=None, metavar="NAME",
                 help="With --model: also add the bank (and its sensitivity record) to the bank registry "
                      "as NAME (`kvz bank list`)."),
    click.option("--sensitivity/--no-sensitivity", "sensitivity", default=True, show_default=True,
                 help="With --model: measure the per-tensor KL sensitivity record that --target-kl and "
                      "--eps-scope weighted need (about 2 x layers short forward passes per text, up to 4)."),
    click.option("--model-id", "model_id", default=None,
                 help="With --model: the bank's model name (default: the model's name, e.g. the GGUF file's "
                      "stem without its quantisation suffix)."),
    click.option("-q", "--quiet", "quiet", is_flag=True, help="No progress on stderr."),
]


def model_options(f):
    """Attach the ``--model`` option set to a click command (outermost option first)."""
    for opt in reversed(_OPTIONS):
        f = opt(f)
    return f


class _Bars:
    """One tqdm bar per stage on stderr (``capture`` in tokens, ``fit`` in blocks, ``sensitivity`` in passes)."""

    UNITS = {"capture": "tok", "fit": "block", "sensitivity": "pass"}

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.stage: str | None = None
        self.bar: Any = None

    def __call__(self, stage: str, advance: int, total: int) -> None:
        if self.quiet:
            return
        if stage != self.stage:
            self.close()
            from tqdm import tqdm

            self.stage = stage
            self.bar = tqdm(total=total, desc=stage, unit=self.UNITS.get(stage, "it"), file=sys.stderr, leave=False)
        self.bar.update(advance)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def capture_records(caches, out: str, force: bool) -> list:
    """``[(cache path, CaptureStats or None)]`` of ``kvz calibrate CACHES...`` (the statistics
    ``kvz capture --attention-stats`` put beside each cache, checked against it), read before the
    fit so that a malformed record is one line at once. A bank sidecar ``<out>.attention.json``
    that exists beside no bank is not replaced without ``force``."""
    from alignpred.bank import AttentionStats, find_capture_stats
    from alignpred.errors import OutputExistsError

    side = AttentionStats.path_for(out)
    if os.path.lexists(side) and not os.path.lexists(out) and not force:
        raise OutputExistsError(f"{side} exists; pass --force to replace it, or choose another output with -o")
    return [(c.path, find_capture_stats(c)) for c in caches]


def write_attention_sidecar(records, bank, out: str) -> tuple[dict | None, list[str]]:
    """After ``bank`` was saved to ``out``: fit its attention statistics from the captures that carry
    them and write ``<out>.attention.json`` (none carry them: nothing is written, and a sidecar left
    there by the bank ``out`` replaced is removed). Returns ``(summary or None, lines to print)``."""
    from alignpred.bank import AttentionStats, AttentionStatsError, fit_attention_stats

    side = AttentionStats.path_for(out)
    have = [(p, r) for p, r in records if r is not None]
    lacking = [os.path.basename(p) for p, r in records if r is None]
    lines = []
    if not have:
        if side.is_file():
            try:
                stale = AttentionStats.load(side).bank_id != bank.id
            except AttentionStatsError:
                stale = True
            if stale:
                side.unlink()
                lines.append(f"removed {side}: the attention statistics of the bank {out} replaced")
        return None, lines
    stats = fit_attention_stats([r for _, r in have], bank,
                                meta={"sources": [os.path.basename(p) for p, _ in have], "command": "kvz calibrate"})
    stats.save(side)
    tokens = sum(r.n_tokens for _, r in have)
    lines.append(f"{side}: attention statistics of {len(have)} of {len(records)} captures ({tokens} tokens)")
    if lacking:
        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        lines.append(f"  without statistics (not used for them): {shown}; capture with --attention-stats to include "
                     "them")
    return {"path": str(side), "captures": len(have), "tokens": tokens, "without": lacking}, lines


def load_for_cli(model_path: str, quiet: bool, command: str = "calibrate --model", needs: str = "the texts"):
    """``(path, model, tokenizer)`` for a command that takes ``--model`` (a directory or a .gguf): a missing
    extra, a bad path or a model without tokenizer is one :class:`click.ClickException` line; "loading ..."
    goes to stderr unless ``quiet``. (``kvz capture --model`` can use it too.)"""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        if str(model_path).lower().endswith(".gguf"):
            import gguf  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"{command} needs {e.name or 'torch/transformers'}; {_HINT}") from None
    from kvz.integrations.hf.capture import load_model

    mp = Path(model_path).expanduser()
    if not quiet:
        click.echo(f"loading {mp} ...", err=True)
    try:
        model, tokenizer = load_model(mp)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if tokenizer is None:
        raise click.ClickException(f"{mp}: the model has no tokenizer; {command} needs one for {needs}")
    return mp, model, tokenizer


def calibrate_model(*, model_path: str, texts: str | None, out: str, tokens: int | None = None,
                    register_name: str | None = None, sensitivity: bool = True, model_id: str | None = None,
                    quiet: bool = False, force: bool = False, rank: int = 0, depth: int = 1, group_size: int = 3,
                    no_rotations: bool = False, eps_cal: float = 0.03, as_json: bool = False) -> dict:
    """What ``kvz calibrate --model`` does; raises :class:`click.ClickException` / ``UsageError`` for bad input.
    Writes ``out`` (the bank) and, with ``sensitivity``, ``<out stem>.sensitivity.json`` beside it; with
    ``register_name`` both also go to the user's bank folder. Prints the result and returns it."""
    from alignpred.errors import KvzError
    from kvz.integrations.hf.calibrate import calibrate_model as run
    from kvz.integrations.hf.calibrate import model_name, read_texts, register
    from kvz.integrations.hf.rope import UnsupportedRope
    from kvz.integrations.hf.sensitivity import write_sensitivity

    if not texts:
        raise click.UsageError("--model needs --texts DIR (a folder of .txt calibration texts)")
    if os.path.lexists(out) and not force:
        raise click.ClickException(f"{out} exists; pass --force to replace it, or choose another output with -o")
    try:
        docs = read_texts(texts)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    mp, model, tokenizer = load_for_cli(model_path, quiet)
    mid = model_id or model_name(model, mp)
    bars = _Bars(quiet)
    try:
        res = run(model, tokenizer, docs, model_id=mid, tokens=tokens, sensitivity=sensitivity, rank=rank or None,
                  depth=depth, group_size=group_size, rotations=not no_rotations, eps_cal=eps_cal, progress=bars)
    except UnsupportedRope as e:
        raise click.ClickException(f"unsupported model: {e}") from None
    except (ValueError, NotImplementedError, RuntimeError, KvzError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        bars.close()
    res.bank.save(out)
    summary = res.summary()
    summary.update(output=out, bytes=os.path.getsize(out))
    lines = [f"{out}: bank {res.bank.id[:23]}… for {mid} ({summary['bytes']} bytes; {len(res.texts)} texts, "
             f"{res.tokens} tokens)"]
    lines += write_attention_sidecar([], res.bank, out)[1]  # no statistics on this route: none of a replaced bank
    if res.sensitivity is not None:
        sens = write_sensitivity(res.sensitivity, Path(out).with_suffix(".sensitivity.json"))
        summary["sensitivity_file"] = str(sens)
        lines.append(f"{sens}: sensitivity record, KL per NRMSE² {res.sensitivity['kl_per_nrmse2']:.3g} "
                     f"(KL at eps 0.0267 ≈ {0.0267 ** 2 * res.sensitivity['kl_per_nrmse2']:.2e})")
    if register_name is not None:
        try:
            entry = register(out, register_name, res.sensitivity, force=force)
        except KvzError as err:
            raise click.ClickException(str(err)) from None
        summary["registered"] = {"name": entry.name, "path": entry.path}
        lines.append(f"registered as {entry.name!r} ({entry.path}): kvz compress --bank {entry.name}"
                     + (" [--target-kl KL]" if res.sensitivity is not None else ""))
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)
    return summary


@click.command("calibrate")
@model_options
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Output bank (.h5).")
@click.option("-f", "--force", is_flag=True, help="Replace OUT (and a registered bank of that NAME) if it exists.")
@click.option("--json", "as_json", is_flag=True)
def calibrate_model_command(model_path, texts, tokens, register_name, sensitivity, model_id, quiet, out, force,
                            as_json):
    """Fit a calibration bank for a model from texts: capture, fit, sensitivity, register (default fit
    options; ``kvz calibrate --model`` also takes ``kvz calibrate``'s --rank, --depth, ...)."""
    if not model_path:
        raise click.UsageError("give --model M (a model directory or a .gguf file)")
    calibrate_model(model_path=model_path, texts=texts, out=out, tokens=tokens, register_name=register_name,
                    sensitivity=sensitivity, model_id=model_id, quiet=quiet, force=force, as_json=as_json)
