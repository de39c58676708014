"""RoPE metadata of the baselines that code keys pre-RoPE (KVQuant-style, covrot): the parameters
from kvz-cache metadata, a tensor name's layer, and RoPE undone / applied with them."""
from __future__ import annotations

import json
import re

import numpy as np

__all__ = ["rope_params", "layer_index", "key_rope"]

_LAYER = re.compile(r"layers\.(\d+)\.(key|value)$")


def rope_params(meta) -> dict | None:
    """{'roped': bool, 'theta': [per layer], 'pairing': str, 'offset': int} from kvz-cache metadata, or None."""
    if not meta:
        return None
    roped = str(meta.get("keys_roped", "false")).strip().lower() in ("true", "1", "yes")
    if not roped:
        return {"roped": False}
    th = meta.get("rope_theta")
    if th is None:
        return None
    th = json.loads(th) if isinstance(th, str) else th
    th = [float(v) for v in (th if isinstance(th, (list, tuple)) else [th])]
    return {"roped": True, "theta": th, "pairing": str(meta.get("rope_pairing", "half")),
            "offset": int(meta.get("position_offset", 0) or 0)}


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def key_rope(x: np.ndarray, name: str, rp: dict | None, inverse: bool, offset: int | None = None) -> np.ndarray:
    """Undo (inverse=True) or apply RoPE to keys [H, T, d] (float32); identity if no RoPE is known/needed."""
    if not rp or not rp.get("roped"):
        return x
    from alignpred.cache import apply_rope
    li = layer_index(name)
    th = rp["theta"]
    theta = th[li] if li is not None and li < len(th) else th[-1]
    off = rp["offset"] if offset is None else offset
    return apply_rope(x, np.arange(off, off + x.shape[-2]), theta, inverse=inverse, pairing=rp["pairing"])
