"""Bring your own model: texts → captured K/V caches → a calibration bank (+ its sensitivity record).

:func:`calibrate_model` is what ``kvz calibrate --model M --texts DIR`` runs: every text is prefilled
through the model (CPU, float32) and its full K/V recorded with the exact RoPE the model applied, as
``kvz capture`` does (:func:`~kvz.integrations.hf.capture.record_kv`), stored as bfloat16 kvz-cache
files in a temporary folder and loaded back with :func:`alignpred.load_cache`; a bank is fitted on them
(:func:`alignpred.fit_bank`) and, optionally, its per-tensor KL sensitivity measured on windows of the
same texts (:func:`~kvz.integrations.hf.sensitivity.measure_sensitivity`), which the weighted scope and
``target_kl`` read. :func:`register` puts both in the user's bank folder.

The bank's model id is the model's *name* (:func:`model_name`), never a local path.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alignpred import Bank

__all__ = ["model_name", "read_texts", "calibrate_model", "register", "CalibrationResult", "Progress"]

#: ``progress(stage, advance, total)``: ``stage`` is ``capture`` (tokens), ``fit`` (blocks) or
#: ``sensitivity`` (forward passes); ``total`` is the stage's size, the same on every call of a stage.
Progress = Callable[[str, int, int], None]

_QUANT = re.compile(r"[.-](?:u?q\d[\w]*|iq\d[\w]*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)


def _clean(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip()).strip("-.")
    return name[:100]


def model_name(model=None, path: str | os.PathLike | None = None) -> str:
    """The model's name for a bank's ``model`` id: a GGUF file's stem without its quantisation suffix
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``; the GGUF's ``general.name`` when the
    stem is only a quantisation tag), a model directory's name, else the basename of the config's
    ``_name_or_path`` (a hub id ``org/name`` gives ``name``) or its ``model_type``. Only letters, digits,
    ``.``, ``_`` and ``-`` are kept (the registry's name rule)."""
    if path is not None:
        p = Path(path).expanduser()
        if p.suffix.lower() == ".gguf":
            stem = _clean(_QUANT.sub("", p.stem))
            if stem and not _QUANT.fullmatch("." + stem):
                return stem
            general = _gguf_name(p)
            if general:
                return general
        elif p.name:
            return _clean(p.name)
    if model is not None:
        cfg = model.config
        raw = str(getattr(cfg, "_name_or_path", "") or "").rstrip("/\\")
        base = _clean(re.split(r"[/\\]", raw)[-1]) if raw else ""
        if base:
            return base
        return _clean(str(getattr(cfg, "model_type", "") or type(model).__name__))
    raise ValueError("model_name needs a model or a path")


def _gguf_name(path: Path) -> str:
    try:
        import gguf

        f = gguf.GGUFReader(str(path)).fields.get("general.name")
        return _clean(bytes(f.parts[f.data[0]]).decode("utf-8")) if f is not None else ""
    except Exception:  # noqa: BLE001 - a name is a nicety; the stem is used otherwise
        return ""


def read_texts(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[str, str]]:
    """``(name, text)`` of the UTF-8 texts: a folder's ``*.txt`` files (sorted, not recursive) or the
    files given. Empty texts are skipped; ValueError if none is left."""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source).expanduser()
        if p.is_dir():
            files = sorted(p.glob("*.txt"))
            if not files:
                raise ValueError(f"{p}: no .txt files")
        elif p.is_file():
            files = [p]
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    else:
        files = [Path(s).expanduser() for s in source]
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{f}: not valid UTF-8 text") from None
        if text.strip():
            out.append((f.stem, text))
    if not out:
        raise ValueError("no calibration text (all empty)")
    return out


@dataclass
class CalibrationResult:
    """What :func:`calibrate_model` made: the bank, its sensitivity record (or None) and a summary."""

    bank: Bank
    sensitivity: dict | None
    model_id: str
    texts: list = field(default_factory=list)  # [{"source", "tokens"}]
    tokens: int = 0
    seconds: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"model": self.model_id, "bank_id": self.bank.id, "texts": self.texts, "tokens": self.tokens,
                "positions": self.bank.config["n_positions"], "sensitivity": self.sensitivity is not None,
                "kl_per_nrmse2": self.sensitivity["kl_per_nrmse2"] if self.sensitivity else None,
                "seconds": self.seconds}


def _token_ids(tokenizer, texts, tokens: int | None) -> list[tuple[str, list[int]]]:
    from kvz.integrations.hf.capture import tokenize

    out = []
    for name, text in texts:
        ids = tokenize(tokenizer, text) if isinstance(text, str) else [int(t) for t in text]
        if tokens is not None:
            ids = ids[:tokens]
        if len(ids) < 2:
            raise ValueError(f"{name}: fewer than 2 tokens")
        out.append((name, ids))
    return out


def _capture(model, docs, model_id: str, folder: str, chunk: int, progress: Progress | None) -> list:
    from alignpred import load_cache
    from kvz.integrations.hf.capture import cache_metadata, record_kv, write_cache_atomic
    from kvz.integrations.hf.rope import rope_thetas

    total = sum(len(ids) for _, ids in docs)
    caches = []
    for i, (name, ids) in enumerate(docs):
        tensors, spec, info = record_kv(model, ids, chunk=chunk, dtype="bfloat16")
        meta = cache_metadata(info["layer_types"], rope_thetas(model, spec), ids, name, model=model_id, rope=spec)
        path = write_cache_atomic(tensors, meta, os.path.join(folder, f"{i:03d}.safetensors"))
        del tensors
        caches.append(load_cache(path))
        if progress:
            progress("capture", len(ids), total)
    return caches


def _windows(docs, context: int, score_tokens: int, n: int) -> tuple[list, int]:
    """Up to ``n`` windows (the start of each text); ``context`` shrinks to fit the longest text."""
    longest = max(len(ids) for _, ids in docs)
    context = min(context, longest - score_tokens)
    if context < 16:
        raise ValueError(f"the sensitivity measure needs a text of at least {16 + score_tokens} tokens")
    return [(name, ids) for name, ids in docs if len(ids) >= context + score_tokens][:n], context


def calibrate_model(model, tokenizer, texts, *, model_id: str | None = None, tokens: int | None = None,
                    sensitivity: bool = True, eps: float = 0.0267, rank: int | None = None, depth: int = 1,
                    group_size: int = 3, eps_cal: float = 0.03, rotations: bool = True, chunk: int = 1024,
                    sensitivity_windows: int = 4,
                    context: int = 256, score_tokens: int = 16, progress: Progress | None = None,
                    workdir: str | os.PathLike | None = None) -> CalibrationResult:
    """Fit a bank for ``model`` on ``texts`` (``(name, text)`` pairs as :func:`read_texts` gives, or
    ``(name, token ids)``), keeping the first ``tokens`` tokens (BOS included) of each.

    ``sensitivity``: also measure the per-tensor KL sensitivity at ``eps`` on up to
    ``sensitivity_windows`` windows (``context`` cached + ``score_tokens`` scored tokens at the start of
    each text). ``model_id`` defaults to :func:`model_name`. ``workdir``: where the temporary caches go
    (default: the system's temporary folder). Fit options as :func:`alignpred.fit_bank`."""
    from alignpred import fit_bank
    from kvz.integrations.hf.capture import require_modules

    require_modules("torch", "transformers")
    if tokens is not None and tokens < 2:
        raise ValueError("tokens must be >= 2")
    texts = list(texts)
    if not texts:
        raise ValueError("no calibration text")
    if any(isinstance(t, str) for _, t in texts) and tokenizer is None:
        raise ValueError("the model has no tokenizer: pass token ids")
    model_id = model_id or model_name(model)
    docs = _token_ids(tokenizer, texts, tokens)
    secs = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvz-calibrate-", dir=workdir) as folder:
        caches = _capture(model, docs, model_id, folder, chunk, progress)
        secs["capture"] = round(time.perf_counter() - t0, 2)
        n_blocks = len(list(caches[0].layout.blocks()))
        t1 = time.perf_counter()
        bank = fit_bank(caches, rank=rank, depth=depth, group_size=group_size, eps_cal=eps_cal, rotations=rotations,
                        progress=(lambda n: progress("fit", n, n_blocks)) if progress else None)
        secs["fit"] = round(time.perf_counter() - t1, 2)
        del caches
    rec = None
    if sensitivity:
        from kvz.integrations.hf.bridge import text_config
        from kvz.integrations.hf.sensitivity import measure_sensitivity

        ws, ctx = _windows(docs, context, score_tokens, sensitivity_windows)
        passes = len(ws) * (2 * text_config(model).num_hidden_layers + 2)
        t2 = time.perf_counter()
        rec = measure_sensitivity(model, ws, bank, model_id=model_id, eps=eps, context=ctx,
                                  score_tokens=score_tokens,
                                  progress=(lambda n: progress("sensitivity", n, passes)) if progress else None)
        secs["sensitivity"] = round(time.perf_counter() - t2, 2)
    return CalibrationResult(bank, rec, model_id, [{"source": n, "tokens": len(i)} for n, i in docs],
                             sum(len(i) for _, i in docs), secs)


def register(bank_path: str | os.PathLike, name: str | None = None, sensitivity: dict | None = None,
             force: bool = False):
    """Add the bank file to the user's bank folder (:func:`alignpred.bank.add`) and write its sensitivity
    record beside it as ``<name>.sensitivity.json``; returns the registry entry."""
    from alignpred.bank import add
    from kvz.integrations.hf.sensitivity import write_sensitivity

    entry = add(bank_path, name=name, force=force)
    if sensitivity is not None:
        write_sensitivity(sensitivity, Path(entry.path).with_suffix(".sensitivity.json"))
    return entry
