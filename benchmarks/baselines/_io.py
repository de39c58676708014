"""Loading real KV caches (bf16/f16/f32 safetensors) and making synthetic ones, for the baseline benchmarks only."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DT = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
_NAME = re.compile(r"^layers\.(\d+)\.(key|value)$")


def load_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """Read a safetensors file into ``{name: array}`` (bf16 as ``ml_dtypes.bfloat16``) plus its ``__metadata__``."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        dt = np.dtype(_DT[info["dtype"]])
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw, dtype=dt, count=(b - a) // dt.itemsize, offset=base + a)
        out[name] = arr.reshape(info["shape"]).copy()
    return out, meta


def kv_only(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep the ``layers.{i}.key|value`` tensors, ordered by layer then key/value."""
    keys = [k for k in tensors if _NAME.match(k)]
    keys.sort(key=lambda k: (int(_NAME.match(k).group(1)), _NAME.match(k).group(2)))
    return {k: tensors[k] for k in keys}


def synthetic_cache(n_layers: int = 2, kv_heads: int = 1, T: int = 300, D: int = 64, seed: int = 0,
                    dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """Token-correlated (AR(1)), channel-correlated data with a few outlier key channels, roughly KV-like."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_layers):
        for kind in ("key", "value"):
            mix = rng.standard_normal((D, D)) / np.sqrt(D)
            scale = np.exp(rng.normal(0, 0.6, D))
            if kind == "key":
                scale[rng.choice(D, max(1, D // 32), replace=False)] *= 8.0
            rho = 0.9 if kind == "key" else 0.6
            z = rng.standard_normal((kv_heads, T, D))
            for t in range(1, T):
                z[:, t] = rho * z[:, t - 1] + np.sqrt(1 - rho ** 2) * z[:, t]
            x = (z @ mix + rng.standard_normal(D) * 0.5) * scale
            out[f"layers.{i}.{kind}"] = x.astype(np.float32).astype(dtype)
    return out
