"""A model's weights fingerprint, bound into every engine store key (vLLM blocks, chunk store, SGLang
pages), so that two models that share a name (a fine-tune in a folder of the same name, two
revisions, two quantisations) never read each other's KV.

The fingerprint is cheap on any model size: sha256 over ``config.json`` and, for each weights file
(``*.safetensors``, ``*.gguf``, ``*.bin``, ``*.pt``, ``*.pth``, by relative path), its name, its size,
its first and last 64 KiB (a safetensors or GGUF header: every tensor's name, dtype, shape and
offset) and 16 samples of 4 KiB spread through it. Fine-tuning changes every tensor, so any two
different checkpoints differ in the samples; reading 200 KiB per file costs milliseconds where a full
hash of a 16 GB checkpoint would cost a minute at every engine start. It is not a security
boundary: someone who can write the weights directory can forge any key anyway.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> with open(os.path.join(d, "model.safetensors"), "wb") as f:
...     _ = f.write(bytes(range(256)) * 1000)
>>> a = weights_fingerprint(d)
>>> a.startswith("w") and len(a) == 17, a == weights_fingerprint(d)
(True, True)
>>> with open(os.path.join(d, "model.safetensors"), "r+b") as f:
...     _ = f.seek(100); _ = f.write(b"fine-tuned")
>>> weights_fingerprint(d) != a
True
>>> weights_fingerprint(os.path.join(d, "missing")) is None   # not a local model: no fingerprint
True
"""
from __future__ import annotations

import hashlib
import os
import threading

__all__ = ["weights_fingerprint"]

_WEIGHTS = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_EDGE = 64 << 10
_SAMPLE = 4 << 10
_SAMPLES = 16
_memo: dict[tuple, str] = {}
_lock = threading.Lock()


def _files(path: str) -> list[tuple[str, str]]:
    """(relative name, full path) of the config and weights files of a model directory or file."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    out = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in names:
            if n == "config.json" or n.endswith(_WEIGHTS):
                full = os.path.join(root, n)
                out.append((os.path.relpath(full, path).replace(os.sep, "/"), full))
    return sorted(out)


def _digest_file(h, name: str, full: str) -> None:
    size = os.path.getsize(full)
    h.update(f"{name}\0{size}\0".encode())
    with open(full, "rb") as f:
        if size <= 2 * _EDGE + _SAMPLES * _SAMPLE:
            h.update(f.read())
            return
        h.update(f.read(_EDGE))
        for i in range(_SAMPLES):
            f.seek(_EDGE + (size - 2 * _EDGE - _SAMPLE) * i // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))


def _local(model: str) -> str | None:
    """A local path for ``model``: itself, or its snapshot in the Hugging Face cache (never a download)."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if "/" not in model or model.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cfg = try_to_load_from_cache(model, "config.json")
    except Exception:  # a malformed id: no fingerprint, not an error
        return None
    return os.path.dirname(cfg) if isinstance(cfg, str) else None


def weights_fingerprint(model) -> str | None:
    """``"w"`` + 16 hex digits identifying the weights at ``model`` (a directory, a weights file, or a
    Hugging Face id already in the local cache); None when there is nothing local to fingerprint
    (then keys bind the model's name only). Memoised per file sizes and modification times."""
    if not model:
        return None
    path = _local(str(model))
    if path is None:
        return None
    try:
        files = _files(path)
        if not files:
            return None
        stats = [(n, os.stat(f)) for n, f in files]
        stamp = (os.path.realpath(path), tuple((n, st.st_size, st.st_mtime_ns) for n, st in stats))
        with _lock:
            if stamp in _memo:
                return _memo[stamp]
        h = hashlib.sha256(b"kvz-weights-1\0")
        for name, full in files:
            _digest_file(h, name, full)
    except OSError:
        return None
    fp = "w" + h.hexdigest()[:16]
    with _lock:
        _memo[stamp] = fp
    return fp
