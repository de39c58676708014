"""Arrays from other libraries as numpy arrays, without a copy where the memory allows it.

torch is never imported here: a CPU ``torch.Tensor`` is recognised by duck typing and viewed
through ``Tensor.numpy()`` (bfloat16 through its int16 bits and ml_dtypes), so the core codec
keeps torch optional. Anything else goes through ``np.asarray``.

>>> import numpy as np
>>> a = np.zeros((2, 3), np.float16)
>>> as_numpy(a) is a
True
"""
from __future__ import annotations

import numpy as np

from alignpred.errors import LayoutError


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach") and hasattr(x, "dtype")


def as_numpy(x, *, writable: bool = False) -> np.ndarray:
    """A numpy view of ``x`` (numpy array, CPU torch tensor — bfloat16 included — or anything
    ``np.asarray`` accepts). A torch tensor on another device is refused (copy it to the CPU
    first: kvz does not move data between devices behind your back). With ``writable`` the
    result must share memory with ``x`` and be writable (decode-into buffers)."""
    if isinstance(x, np.ndarray):
        if writable and not x.flags.writeable:
            raise LayoutError("output buffer is read-only")
        return x
    if _is_torch(x):
        if getattr(x.device, "type", "cpu") != "cpu":
            raise LayoutError(f"tensor is on {x.device}; kvz reads CPU memory: call .cpu() first (or decode into "
                              "a CPU staging buffer and copy)")
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if writable:
        raise LayoutError(f"output buffer of type {type(x).__name__} is not a numpy array or CPU torch tensor")
    return np.asarray(x)
