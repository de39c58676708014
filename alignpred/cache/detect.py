"""Checks that catch silent loss of compression before any work is done.

* A bank fitted with RoPE undone on keys, used on a cache whose metadata says its keys carry no
  RoPE, is a mismatch (:class:`BankMismatchError`): the keys would be coded in the wrong frame.
* Keys that *look* rotated although the metadata says ``keys_roped: false`` raise a
  :class:`KvzWarning`: RoPE turns the fastest channel pair by one radian per token (its inverse
  frequency is 1 whatever the base), so the pair's mean over tokens vanishes unless the rotation
  is taken out; if demodulating it by 1 rad/token concentrates far more energy in the mean than
  leaving it alone, the keys carry RoPE. Measured on Gemma 3 270M keys: ratio 10^2..10^4 with
  RoPE, < 1 with it undone.
"""
from __future__ import annotations

import warnings

import numpy as np

from alignpred.cache.layout import tensor_name
from alignpred.errors import BankMismatchError, KvzWarning

RATIO = 20.0  # demodulated / plain mean energy of the fastest pair above which keys look rotated
FRACTION = 0.05  # ... and the demodulated mean must hold this much of the pair's energy (noise: ~1/T)
MIN_TOKENS = 64
SAMPLE_TOKENS = 2048


def rotation_ratio(k: np.ndarray, pairing: str = "half") -> tuple[float, float]:
    """For key rows ``k [T, d]``: ``(ratio, fraction)`` — the energy of the mean of the fastest
    RoPE pair demodulated at 1 rad/token over the energy of its plain mean, and the demodulated
    mean's share of the pair's energy (Gemma 3 keys with RoPE: 0.15–0.66; noise: about 1/T)."""
    k = np.asarray(k, np.float64)
    T, d = k.shape
    a, b = (k[:, 0], k[:, d // 2]) if pairing == "half" else (k[:, 0], k[:, 1])
    z = a + 1j * b
    t = np.arange(T)
    energy = float(np.mean(abs(z) ** 2))
    if not energy > 0:
        return 0.0, 0.0
    plain = abs(z.mean()) ** 2
    demod = abs((z * np.exp(-1j * t)).mean()) ** 2
    return float(demod / max(plain, 1e-12 * energy)), float(demod / energy)


def looks_roped(tensors: dict, layout, layers: int = 3) -> tuple[bool, str, float]:
    """Whether the keys of the first ``layers`` layers look RoPE-rotated: ``(verdict, tensor
    name, best ratio)``."""
    if layout.head_dim % 2 or layout.n_tokens < MIN_TOKENS:
        return False, "", 0.0
    best = (0.0, "")
    for i in range(min(layers, layout.num_layers)):
        arr = tensors[tensor_name(i, "K")]
        arr = arr[0] if layout.batch_dim else arr
        for h in range(min(layout.kv_heads, 2)):
            k = np.asarray(arr[h, :SAMPLE_TOKENS], np.float32)
            for pairing in ("half", "interleaved"):
                r, frac = rotation_ratio(k, pairing)
                if frac > max(FRACTION, 10.0 / len(k)):
                    best = max(best, (r, tensor_name(i, "K")))
    return best[0] > RATIO, best[1], best[0]


def check_rope(layout, bank, tensors) -> None:
    """Refuse a RoPE-undo bank for keys said to carry no RoPE; warn on keys that look rotated."""
    if layout.keys_roped:
        return
    roped, name, ratio = looks_roped(tensors, layout)
    if bank.config.get("rope_undone") is True:
        hint = f" ({name} does look RoPE-rotated)" if roped else ""
        raise BankMismatchError("the bank was fitted on keys with RoPE undone, but the cache's metadata says its "
                                f"keys carry no RoPE{hint}: if they do (keys from a transformers cache always "
                                "do), add keys_roped=true and rope_theta (or rope) to the metadata; otherwise "
                                "fit a bank on caches like this one (kvz calibrate)")
    if roped:
        warnings.warn(f"{name} looks RoPE-rotated (demodulation ratio {ratio:.0f}) but the metadata says "
                      "keys_roped=false: keys will compress about 1 bit/value worse. Add keys_roped=true and "
                      "rope_theta (or rope) to the metadata (kvz capture records them)", KvzWarning, stacklevel=3)


# -- the given RoPE checked, not trusted --------------------------------------------------------
THETA_GRID = tuple(10.0 ** (x / 8) for x in range(16, 65))  # 1e2 .. 1e8, 8 per decade
BETTER = 1.03  # a candidate theta must concentrate this much more energy (and +0.005) to be named
CHECK_TOKENS = 512
SAMPLE_LAYERS = 3  # layers of each rotary table checked first (first, middle, last); all on a mismatch


def _pairs(k: np.ndarray, rotary_dim: int, pairing: str) -> np.ndarray:
    half = rotary_dim // 2
    if pairing == "half":
        return k[:, :half] + 1j * k[:, half:rotary_dim]
    return k[:, 0:rotary_dim:2] + 1j * k[:, 1:rotary_dim:2]


def frame_scores(k: np.ndarray, inv_freqs, rotary_dim: int, pairing: str = "half") -> np.ndarray:
    """For RoPE-rotated key rows ``k [T, d]``: the share of the rotary channels' energy that lies
    in their mean over tokens once each candidate's rotation (rows of ``inv_freqs [C, rotary_dim/2]``;
    zeros = nothing undone) is taken out. Keys have strong per-channel means in the right frame;
    a wrong base leaves slow pairs turning and smears them, so the right ``inv_freq`` scores
    highest. The token offset does not matter (it only turns each mean)."""
    z = _pairs(np.asarray(k, np.float64), rotary_dim, pairing)  # [T, P]
    energy = float(np.mean(np.abs(z) ** 2, axis=0).sum())
    if not energy > 0:
        return np.zeros(len(inv_freqs))
    inv = np.asarray(inv_freqs, np.float64)  # [C, P]
    w = np.exp(-1j * inv)  # [C, P]: one token's turn; sum_t z_t w^t by Horner's rule
    acc = np.zeros(inv.shape, np.complex128)
    for zt in z[::-1]:
        acc = acc * w + zt
    means = acc / len(z)
    return (np.abs(means) ** 2).sum(axis=1) / energy


def _default_inv(theta: float, rotary_dim: int) -> np.ndarray:
    return theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _fmt(theta: float) -> str:
    return f"{float(f'{theta:.2g}'):g}"


def _check_layer(layout, tensors, i: int, table):
    """``(layer, likely base, given score, best score, worse than none)`` if layer ``i``'s keys
    look rotated with the given table, else None."""
    arr = tensors[tensor_name(i, "K")]
    k = np.asarray((arr[0] if layout.batch_dim else arr)[0, :CHECK_TOKENS], np.float32)
    rd = table.rotary_dim
    cands = np.stack([np.asarray(table.inv_freq, np.float64), np.zeros(rd // 2)]
                     + [_default_inv(th, rd) for th in THETA_GRID])
    s = frame_scores(k, cands, rd, table.pairing)
    given, none, grid = s[0], s[1], s[2:]
    best = int(np.argmax(grid))
    if grid[best] >= BETTER * given + 0.005:
        return i, THETA_GRID[best], given, grid[best], given < none
    return None


def check_rope_theta(layout, tensors) -> None:
    """Check the RoPE the metadata gives against the keys themselves: a base that leaves the keys
    looking rotated is a :class:`KvzWarning` naming the likely base (per layer type), and one
    that makes the frame worse than undoing nothing is a :class:`LayoutError` (a wrong theta
    costs up to a bit per key value: measured 3.79 bpv with the model's own bases, 4.65 with
    ``rope_theta=1e6`` for every layer of Gemma 3). Layers that share one rotary table are checked
    by a sample (``SAMPLE_LAYERS``: first, middle, last) and all of them only when the sample shows a
    mismatch, so every layer a warning or error names was checked (the check cost 0.1 s of a 0.6 s
    compress of 448 tokens when it scored all 18 layers of Gemma 3). A profile with ``trust_rope``
    (``compress(..., profile=Profile(trust_rope=True))``) skips it."""
    from alignpred.errors import LayoutError

    spec = layout.rope_spec
    if spec is None or layout.n_tokens < MIN_TOKENS:
        return
    types = list(layout.layer_types) if layout.layer_types else ["layer"] * layout.num_layers
    groups: dict = {}  # layers that share one rotary table: checked by a sample first
    for i in range(layout.num_layers):
        table = spec.table(i)
        if table is None or table.rotary_dim < 4:
            continue
        key = (types[i], table.rotary_dim, table.pairing, np.asarray(table.inv_freq, np.float64).tobytes())
        groups.setdefault(key, []).append((i, table))
    wrong: dict = {}
    worse = []
    for members in groups.values():
        sample = [members[j] for j in sorted({round(x) for x in np.linspace(0, len(members) - 1, SAMPLE_LAYERS)})]
        checked = {i: _check_layer(layout, tensors, i, t) for i, t in sample}
        if any(checked.values()):  # a mismatch in the sample: every layer of the group is checked and named
            checked.update({i: _check_layer(layout, tensors, i, t) for i, t in members if i not in checked})
        found = [checked[i] for i, _ in members if checked.get(i) is not None]
        for i, th, given, best, is_worse in found:
            wrong.setdefault(types[i], []).append((i, th, given, best))
            if is_worse:
                worse.append(i)
    if not wrong:
        return
    parts = []
    for lt, rows in wrong.items():
        th = float(np.median([r[1] for r in rows]))
        parts.append(f"{lt} layers {', '.join(str(r[0]) for r in rows)} look rotated with a base near {_fmt(th)}")
    fix = ("; give each layer type its own base (rope_theta={'sliding_attention': 1e4, 'full_attention': 1e6} "
           "style, or a rope spec), or let kvz.integrations.hf read RoPE from the model "
           "(save_kv(cache, path, model=model)); compress(..., profile=Profile(trust_rope=True)) / --trust-rope "
           "skips this check")
    msg = "the RoPE in the metadata does not match the keys: " + "; ".join(parts) + fix
    if worse:
        layers = ", ".join(map(str, sorted(worse)))
        raise LayoutError(f"undoing the given RoPE makes layers {layers} worse than undoing none — {msg}")
    warnings.warn(msg + " (compression suffers: about 0.2–0.9 bit/value on Gemma 3)", KvzWarning, stacklevel=3)
