"""Capture the full per-layer K/V cache of any transformers decoder (CPU, float32) as a kvz-cache
safetensors file, with the exact RoPE the model applied to its keys.

:func:`capture_model` prefills token ids (or a text, through the tokenizer) in chunks and
records the key/value states *as they are handed to the cache* — a ``DynamicCache`` subclass
keeps every chunk, so sliding-window layers keep all positions, not only the last window — and
writes:

* tensors ``layers.{i}.key`` / ``layers.{i}.value``, shape ``[kv_heads, T, head_dim]`` (keys
  post RoPE, as cached; values as cached);
* ``__metadata__`` (all strings): ``format`` (``kvz-cache``), ``kvz.version``, ``model``,
  ``layer_types`` (JSON list), ``rope`` (``json.dumps(RopeSpec.to_json())``: per-layer float32
  ``inv_freq``, ``attention_scaling``, pairing — see :mod:`kvz.integrations.hf.rope`),
  ``keys_roped`` (``"true"``), ``position_offset`` (``"0"``), ``token_ids`` (JSON list),
  ``source``; plus ``rope_theta`` / ``rope_pairing`` when every layer has plain default RoPE
  (informational, for readers that predate ``rope``).

RoPE exactness: the spec is read from the model's rotary module for the prefilled length and
checked against the model's rotation function (:func:`~kvz.integrations.hf.rope.rope_spec_from_model`);
during the prefill every rotary call is recorded and must have used exactly those parameters,
otherwise the capture fails. Sequence-length dependent RoPE (dynamic NTK, longrope) is prefilled
in one call when chunking would change its frequencies.

Supported: decoders with a model-level ``rotary_emb`` whose attention calls
``apply_rotary_pos_emb`` — tested on tiny Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and
Gemma 3 models (``tests/codec/test_families.py``) and on the real Gemma 3 270M.

:func:`load_model` loads a Hugging Face model directory or a GGUF file (float32, CPU, offline).
torch / transformers are imported lazily.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT_NAME = "kvz-cache"
FORMAT_VERSION = "1"
DTYPES = ("bfloat16", "float16", "float32")
INSTALL_HINT = "install the model extra: pip install -e '.[model]'"

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "DTYPES", "INSTALL_HINT", "require_modules", "load_gguf", "load_model",
           "tokenize",
           "capture_model", "record_kv", "cache_metadata", "write_cache_atomic", "safetensors_chunks"]


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def require_modules(*names: str) -> None:
    """Raise ImportError with the install hint if any of the modules ``names`` cannot be imported."""
    missing = []
    for name in names:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"missing {', '.join(missing)}; {INSTALL_HINT}")


# -- loading ---------------------------------------------------------------------------------------
def load_gguf(path: str | os.PathLike):
    """``(model, tokenizer)`` from a GGUF file, dequantized to float32 by transformers."""
    require_modules("torch", "transformers", "gguf")
    _offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    directory, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - a GGUF without a usable tokenizer still gives K/V from ids
        print(f"kvz: no tokenizer from {path.name} ({e}); pass token ids", file=sys.stderr)
        tokenizer = None
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    try:
        # Manual path: avoids from_pretrained's hard requirement on `accelerate`.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
        if missing or unexpected:
            raise RuntimeError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
        model.tie_weights()
    except (ImportError, TypeError, KeyError, AttributeError):
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model, tokenizer


def load_model(path: str | os.PathLike, device: str = "cpu"):
    """``(model, tokenizer_or_None)`` for a Hugging Face model directory or a ``.gguf`` file:
    float32, eval mode, offline (no download)."""
    require_modules("torch", "transformers")
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        model, tokenizer = load_gguf(p)
    elif p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32, local_files_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception:  # noqa: BLE001 - no tokenizer files: token ids only
            tokenizer = None
    elif p.exists():
        raise ValueError(f"{p}: expected a model directory or a .gguf file")
    else:
        raise FileNotFoundError(f"{p}: no such file or directory")
    model = model.float().eval()
    model.to(device)
    return model, tokenizer


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids as the model normally sees them: BOS first (if it has one), no EOS."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


# -- metadata and writing ---------------------------------------------------------------------------
def cache_metadata(layer_types, rope_theta, token_ids, source: str, *, model: str = "",
                   rope=None, position_offset: int = 0) -> dict[str, str]:
    """The ``__metadata__`` dict of a kvz-cache safetensors file (all strings). ``rope`` (a
    :class:`~alignpred.RopeSpec`) is the exact RoPE; ``rope_theta`` (per-layer bases, or
    ``None``) the informational legacy description of plain default RoPE."""
    meta = {
        "format": FORMAT_NAME,
        "kvz.version": FORMAT_VERSION,
        "model": str(model),
        "layer_types": json.dumps([str(t) for t in layer_types]),
        "keys_roped": "true",
        "position_offset": str(int(position_offset)),
        "token_ids": json.dumps([int(t) for t in token_ids]),
        "source": str(source),
    }
    if rope_theta is not None:
        meta["rope_theta"] = json.dumps([float(t) for t in rope_theta])
        meta["rope_pairing"] = rope.tables[0].pairing if rope is not None and rope.tables else "half"
    if rope is not None:
        meta["rope"] = json.dumps(rope.to_json())
    return meta


_ST_DTYPE = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def _layer_order(name: str):
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return (0, int(parts[1]), parts[2] != "key", name)
    return (1, 0, False, name)


def safetensors_chunks(tensors: dict, metadata: dict[str, str]):
    """Serialize torch tensors as safetensors, deterministically.

    Tensors are laid out in layer order (``layers.0.key``, ``layers.0.value``,
    ``layers.1.key``, ...) and metadata keys are sorted, so the same cache always gives the
    same bytes (``safetensors.torch.save_file`` orders the metadata by hash and varies from run
    to run). Yields byte chunks."""
    import struct

    import torch

    names = sorted(tensors, key=_layer_order)
    header: dict[str, Any] = {"__metadata__": {str(k): str(metadata[k]) for k in sorted(metadata)}}
    offset = 0
    blobs = []
    for name in names:
        t = tensors[name].detach().to("cpu").contiguous()
        dt = str(t.dtype).removeprefix("torch.")
        if dt not in _ST_DTYPE:
            raise ValueError(f"{name}: unsupported dtype {t.dtype}")
        code, size = _ST_DTYPE[dt]
        nbytes = t.numel() * size
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        blobs.append(t)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    yield struct.pack("<Q", len(hb)) + hb
    if sys.byteorder != "little":  # safetensors data is little-endian
        raise NotImplementedError("writing safetensors on a big-endian machine")
    for t in blobs:
        yield t.reshape(-1).view(torch.uint8).numpy().tobytes()


def save_model_dir(model, tokenizer, target: str | os.PathLike, marker: str,
                   marker_name: str = "KVZ_SOURCE.json") -> Path:
    """Write ``model`` (config with its architecture, generation config, weights as safetensors
    without the tied ``lm_head.weight``) and ``tokenizer`` as a Hugging Face model directory at
    ``target``, atomically: built in a sibling temp directory that replaces ``target`` only when
    complete, with ``marker`` (e.g. the source's hash as JSON) in ``marker_name`` last."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=target.parent))
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                 if k != "lm_head.weight"}  # tied; restored by tie_weights()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = [type(model).__name__]
        model.config.to_json_file(str(tmp / "config.json"))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / marker_name).write_text(marker)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def write_cache_atomic(tensors: dict, metadata: dict[str, str], out_path: str | os.PathLike) -> Path:
    """Write ``tensors`` (torch) with ``metadata`` to ``out_path`` atomically (kvz's
    :func:`alignpred.atomic_write`: temp file in the same folder, fsync, rename)."""
    from alignpred import atomic_write

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, safetensors_chunks(tensors, metadata))
    return out


# -- recording ----------------------------------------------------------------------------------------
def record_kv(model, ids: Sequence[int], *, chunk: int = 1024, dtype: str = "float32", progress: bool = False):
    """Prefill ``ids`` (positions ``0..T-1``) and return ``(tensors, spec, info)``: torch tensors
    ``layers.{i}.key/value`` ``[kv_heads, T, head_dim]`` in ``dtype``, the exact
    :class:`~alignpred.RopeSpec`, and ``{"seconds", "chunk", "layer_types"}``."""
    import torch

    from kvz.integrations.hf.bridge import cache_kwarg
    from kvz.integrations.hf.caches import recording_cache_cls
    from kvz.integrations.hf.rope import (
        decoder_of,
        layer_types_of,
        prefill_chunk,
        record_rope_calls,
        rope_spec_from_model,
        text_config,
    )

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    ids = [int(t) for t in ids]
    T = len(ids)
    if T < 1:
        raise ValueError("no tokens to capture")
    config = text_config(model.config)
    vocab = getattr(config, "vocab_size", None)
    if vocab and not all(0 <= t < vocab for t in ids):
        raise ValueError(f"token ids must be in 0..{vocab - 1}")
    layer_types = layer_types_of(config)
    n_layers = config.num_hidden_layers
    spec = rope_spec_from_model(model, T)  # also checks float32 and the rotation
    chunk = prefill_chunk(model, T, chunk)
    store_dtype = getattr(torch, dtype)
    dec = decoder_of(model)
    kw = cache_kwarg(dec)
    device = next(model.parameters()).device
    cache = recording_cache_cls()(config=config, store_dtype=store_dtype)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=T, unit="tok", desc="prefill", file=sys.stderr, leave=False)
    t0 = time.perf_counter()
    try:
        with record_rope_calls(model) as calls, torch.inference_mode():
            for start in range(0, T, chunk):
                piece = torch.tensor([ids[start:start + chunk]], dtype=torch.long, device=device)
                pos = torch.arange(start, start + piece.shape[1], device=device)[None]
                dec(input_ids=piece, position_ids=pos, use_cache=True, **{kw: cache})
                if bar is not None:
                    bar.update(piece.shape[1])
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    _check_rope_calls(calls, spec, layer_types, dec)

    if sorted(cache.recorded) != list(range(n_layers)):
        raise RuntimeError(f"recorded layers {sorted(cache.recorded)} != 0..{n_layers - 1} (shared or skipped "
                           "KV layers are not supported)")
    tensors = {}
    for i in range(n_layers):
        ks, vs = cache.recorded[i]
        k = torch.cat(ks, dim=-2)
        v = torch.cat(vs, dim=-2)
        if k.dim() != 4 or k.shape[0] != 1:
            raise RuntimeError(f"layer {i}: unexpected key shape {tuple(k.shape)}")
        k, v = k[0], v[0]
        if k.shape[-2] != T or v.shape != k.shape:
            raise RuntimeError(f"layer {i}: recorded key {tuple(k.shape)} / value {tuple(v.shape)} for T={T} "
                               "(keys and values of one shape are needed)")
        tensors[f"layers.{i}.key"] = k
        tensors[f"layers.{i}.value"] = v
    del cache
    return tensors, spec, {"seconds": seconds, "chunk": chunk, "layer_types": layer_types}


def _check_rope_calls(calls, spec, layer_types, dec) -> None:
    """Every rotary call of the prefill must have used the spec's parameters."""
    from kvz.integrations.hf.rope import takes_layer_type

    keyed = takes_layer_type(dec.rotary_emb)
    want: dict = {}
    for i, t in enumerate(layer_types):
        table = spec.table(i)
        if table is not None:
            want.setdefault(t if keyed else None, set()).add((table.inv_freq, table.attention_scaling))
    if not calls:
        raise RuntimeError("the model's rotary embedding was never called during the prefill")
    for key, inv, s in calls:
        if key in want and (inv, s) not in want[key]:
            raise RuntimeError(
                f"RoPE parameters changed during the prefill (layer type {key!r}): the recorded spec would not "
                "be exact; capture with one prefill chunk (--chunk larger than the text)")


def capture_model(model, tokenizer, tokens, out_path: str | os.PathLike, dtype: str = "bfloat16",
                  chunk: int = 1024, model_id: str | None = None, *, max_tokens: int | None = None,
                  source: str = "", progress: bool = False,
                  attention_stats: str | os.PathLike | None = None) -> dict[str, Any]:
    """Prefill ``tokens`` (a text — needs ``tokenizer`` — or a sequence of token ids) through
    ``model`` and write its full K/V cache to ``out_path`` (kvz-cache safetensors, atomically).

    ``max_tokens`` keeps the first tokens only (ValueError if there are fewer). ``model_id``
    goes into the ``model`` metadata (default: the config's ``_name_or_path`` or model type).
    ``attention_stats``: also write the attention statistics of the same prefill to this path
    (:func:`~kvz.integrations.hf.querystats.capture_stats`; ``kvz capture --attention-stats`` puts
    them at :func:`alignpred.bank.capture_stats_path` of the output); the prefill is then one
    chunk, with eager attention (``chunk`` is not used).
    Returns a summary dict (``path``, ``tokens``, ``layers``, ``kv_heads``, ``head_dim``,
    ``dtype``, ``seconds``, ``bytes``, ``layer_types``, ``rope``, ``chunk``, ``max_abs_key``,
    ``max_abs_value``; ``attention_stats``: the statistics' path, or None)."""
    require_modules("torch", "transformers")
    if isinstance(tokens, str):
        if tokenizer is None:
            raise ValueError("a text needs a tokenizer; pass token ids instead")
        ids = tokenize(tokenizer, tokens)
    else:
        ids = [int(t) for t in tokens]
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError("tokens must be >= 1")
        if len(ids) < max_tokens:
            raise ValueError(f"text is too short: it has {len(ids)} tokens (including BOS), "
                             f"{max_tokens} were requested")
        ids = ids[:max_tokens]
    stats = None
    if attention_stats is not None:
        from kvz.integrations.hf.querystats import capture_with_stats

        tensors, spec, info, stats = capture_with_stats(model, ids, dtype=dtype, progress=progress)
    else:
        tensors, spec, info = record_kv(model, ids, chunk=chunk, dtype=dtype, progress=progress)
    from kvz.integrations.hf.rope import rope_thetas

    if model_id is None:
        cfg = model.config
        model_id = str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__)
    meta = cache_metadata(info["layer_types"], rope_thetas(model, spec), ids, source, model=model_id, rope=spec)
    stats_path = None
    if stats is not None:
        from kvz.integrations.hf.querystats import capture_stats

        pairing = spec.tables[0].pairing if spec is not None and spec.tables else "half"
        record = capture_stats(model, stats, ids, model_id=model_id, pairing=pairing)
        stats_path = str(record.save(attention_stats))  # first: no cache of this run is left without them
    out = write_cache_atomic(tensors, meta, out_path)
    k0 = tensors["layers.0.key"]
    return {
        "path": str(out),
        "tokens": len(ids),
        "layers": len(info["layer_types"]),
        "kv_heads": int(k0.shape[0]),
        "head_dim": int(k0.shape[-1]),
        "dtype": dtype,
        "seconds": round(info["seconds"], 3),
        "bytes": out.stat().st_size,
        "layer_types": info["layer_types"],
        "rope": spec,
        "chunk": info["chunk"],
        "max_abs_key": [float(tensors[f"layers.{i}.key"].float().abs().max()) for i in range(len(info["layer_types"]))],
        "max_abs_value": [float(tensors[f"layers.{i}.value"].float().abs().max())
                          for i in range(len(info["layer_types"]))],
        "attention_stats": stats_path,
    }
