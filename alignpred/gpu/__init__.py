"""GPU decode of ``.kvz`` files: the entropy stage and the prediction/maps on the device, in
Triton kernels, bit-identical to the CPU (numba) decoder; on a machine without CUDA the same
kernels run in Triton's interpreter (the *simulator*), which is how CI proves them.

Nothing here is imported by ``import alignpred``: torch and triton load when :func:`decode` (or
:mod:`alignpred.gpu.decoder`) is first used, so both stay optional (extra ``kvz[gpu]``: triton;
torch is the engine's CUDA build, or the CPU wheel ``torch==2.13.0`` installed first).

**Kernel language: Triton, not numba's CUDA target.** Measured on this project's 2-core AMD EPYC
VM (numba 0.68.1, numba-cuda 0.30.4, triton 3.9.0, torch 2.13.0+cpu), one small kernel (per
element: a uint32 load, eight rounds of multiply/xor/shift, a store):

* *Simulator speed.* numba's simulator (``NUMBA_ENABLE_CUDASIM=1``; numba 0.68.1 still ships a
  built-in ``numba.cuda`` and its simulator, and numba-cuda's is the same design) runs every
  CUDA thread as a Python thread of scalar numpy operations: 4,096 threads in 2.13 s (built-in)
  and 1.64 s (numba-cuda), 400-520 us per thread, about 50-65 us per thread-iteration. Triton's
  interpreter (``TRITON_INTERPRET=1``) runs each program as numpy operations on whole blocks:
  4,096 elements in 0.089 s with 128-element blocks (22 us each, 2.7 us per element-iteration),
  0.0037 s in one 4,096-element block and 0.10 s in one 65,536-element block (0.11-0.19 us per
  element-iteration): 300-500x the numba simulator. A 2,048-token Gemma 3 270M cache is 75 M
  symbols; at the numba simulator's rate that is hours, in the interpreter minutes.
* *Install.* numba-cuda: 20 MB plus cuda-bindings/cuda-core 48 MB (and the CUDA toolkit wheels
  on a GPU host). Triton: a 286 MB wheel, 999 MB installed, no dependencies of its own; it
  installs next to torch 2.13.0+cpu without touching it. On a serving host it costs nothing:
  every CUDA build of torch (and so vLLM, SGLang, LMCache) already depends on triton.
* *Closeness to the hardware.* Both simulators run the kernel's Python source, not the compiled
  code, so neither proves the code generator. Triton's interpreter keeps Triton's fixed-width
  dtypes (uint32/uint64 wrap-around, int64, float64) as numpy arrays of those dtypes, the
  numba simulator uses numpy scalars whose promotion rules differ from the device's (a Python int
  in an expression widens). The two rounding hazards of the device are handled in the source,
  for either simulator: every float kernel is launched with ``enable_fp_fusion=False`` (no FMA
  contraction: kvz.md §1 forbids it) and the float32 -> bfloat16/float16 casts are the CPU
  kernel's integer bit operations, not the hardware's ``cvt`` (whose NaN payloads differ).
  Triton's model (one program per block of lanes, lanes in lock-step) is what a ``lanes32``
  decode is; the per-thread control numba-cuda gives is not needed.

Entry points: :func:`decode` (a reader's tensors as a torch tensor ``[layers, 2, tokens, heads,
dim]`` on the device), :func:`decode_paged` (straight into vLLM's FlashAttention layout
``[2, num_blocks, block_size, heads, dim]`` or FlashInfer's HND layout ``[num_blocks, 2, heads,
block_size, dim]``); see :mod:`alignpred.gpu.decoder`. Design, parallelism and the projected
H100 throughput: ``docs/gpu.md``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["available", "decode", "decode_paged", "simulated"]


def available() -> bool:
    """Whether the GPU decoder can run here (torch and triton import), on a device or simulated."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def simulated() -> bool:
    """Whether the kernels run in Triton's interpreter (no CUDA device, or ``KVZ_GPU_SIM=1``)."""
    import importlib

    return bool(importlib.import_module("alignpred.gpu.kernels").SIMULATED)


def decode(reader, **kw) -> Any:
    """:func:`alignpred.gpu.decoder.decode` (imports torch and triton on first use)."""
    from alignpred.gpu.decoder import decode as _decode

    return _decode(reader, **kw)


def decode_paged(reader, kv_cache, block_table, layout: str = "flash", **kw) -> Any:
    """:func:`alignpred.gpu.decoder.decode_paged` (imports torch and triton on first use)."""
    from alignpred.gpu.decoder import decode_paged as _decode_paged

    return _decode_paged(reader, kv_cache, block_table, layout=layout, **kw)
