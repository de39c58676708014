"""Speed of kvz next to the coders a KV-cache store would otherwise use, in one run on real caches.

    python -m kvz.benchmarks.speed [--quick] [--json OUT.json] [--plot OUT.png] [--md OUT.md] [CACHES...]
    kvz bench --speed-only [--quick] --out OUT          (the same, into OUT/speed.{json,png,md})

What one run measures (defaults: ``data/eval/*.safetensors``, the 2,048-token held-out Gemma 3 270M
caches; ``--quick``: the first two, fewer repeats, a 4,096-token prefill):

1. **codecs, in process** - kvz encode (``compress``, tensor scope, eps 0.0267) and decode
   (``KvzReader.read()`` and ``read_into`` preallocated buffers) with 1 and all threads (kvz's own
   ``threads=``), next to SZ3 (pysz, per-tensor absolute bound found by the baseline framework so every
   tensor's NRMSE <= eps, like kvz's tensor scope), FP8 e4m3 (ml_dtypes, per-tensor scale), zstd
   (level 3; level 19 decode, its encode timed once) and LMCache 0.5.6's ``AsymK16V8Codec`` (K kept
   in bf16, V in FP8 e4m3 with a per-tensor scale; pure PyTorch, run on the CPU with torch held to
   one intra-op thread). Every decoder produces the cache's own bf16 arrays. The baselines' "all
   threads" runs split the tensors (LMCache: the layers) over a thread pool of that size. Methods are
   *interleaved* (every round runs each method once, in a rotated order) and each figure is the median
   of its rounds, with the CPU time of the process next to the wall time (under load the CPU time is
   the steadier figure for one thread).
2. **kvz 0.1 side by side** - the last 0.1 commit (``d9e1fc2``, a git worktree at ``--kvz01``,
   created if absent) and this tree, each in a fresh subprocess (``PYTHONPATH`` = that tree), warmed
   on a bundled sample, then timed on the same caches: encode/decode values/s and bpv of both.
3. **CLI** - ``kvz decompress X.kvz -o Y.safetensors --force -q`` wall time vs the in-process read,
   with the process start included and excluded (start = ``kvz --help``), interleaved.
4. **environment** - this tree's worker under the default environment and with
   ``OPENBLAS_NUM_THREADS=1`` / ``OMP_NUM_THREADS=1``, interleaved; a default run slower by more than
   ``--env-tolerance`` is flagged.
5. **break-even bandwidth** of every decoder: ``B* = (size_raw - size_c) / t_decode``, the link speed
   below which loading the compressed file and decoding it beats loading raw bf16.
6. **restore vs prefill** - a 16,384-token Gemma 3 270M cache is captured (the prefill, chunked as
   ``capture`` does, is timed), compressed, and restored with ``read_into`` (1 and all threads).
7. a cProfile of one single-thread decode, and bit-identity of decodes across thread counts and
   processes.

Results: JSON (rows, machine, load, command), a plot (Agg) and a Markdown summary.

The package, one module per part: :mod:`.config` (settings), :mod:`.codecs` (what is timed),
:mod:`.codec_study` (1), :mod:`.processes` with :mod:`.worker` (2, 4), :mod:`.cli_study` with
:mod:`.cold_start` (3), :mod:`.restore` (6), :mod:`.profile` (7), :mod:`.acceptance`,
:mod:`.report` and :mod:`.plot` (the outputs), :mod:`.runner` and :mod:`.main` (the run). Names are
loaded lazily, so the worker processes (``python -m kvz.benchmarks.speed.worker``) import only what
they measure.
"""
from __future__ import annotations

import importlib

_WHERE = {
    'BANK': 'config',
    'BATCH_FILES': 'config',
    'BLAS1': 'config',
    'CODECS': 'config',
    'ENV_TOLERANCE': 'config',
    'EPS': 'config',
    'KVZ01_COMMIT': 'config',
    'KVZ01_DIR': 'config',
    'PRESETS': 'config',
    'SCHEMA': 'config',
    'SCOPE': 'config',
    'SECTIONS': 'config',
    'log': 'config',
    'arrays_digest': 'measures',
    'break_even': 'measures',
    'BaselineCodec': 'codecs',
    'KvzCodec': 'codecs',
    'LMCacheCodec': 'codecs',
    'lmcache_status': 'codecs',
    'make_codecs': 'codecs',
    'aggregate': 'codec_study',
    'codec_section': 'codec_study',
    'decode_identity': 'codec_study',
    'make_row': 'codec_study',
    'ensure_kvz01': 'processes',
    'run_worker': 'processes',
    'summarize_env': 'processes',
    'summarize_versions': 'processes',
    'version_env_section': 'processes',
    'cli_section': 'cli_study',
    'kvz_command': 'cli_study',
    'long_text': 'restore',
    'restore_section': 'restore',
    'bound_section': 'profile',
    'map_shapes': 'profile',
    'profile_decode': 'profile',
    'acceptance': 'acceptance',
    'agg_row': 'acceptance',
    'markdown': 'report',
    'write_plot': 'plot',
    'machine': 'runner',
    'print_acceptance': 'runner',
    'render': 'runner',
    'run': 'runner',
    'main': 'main',
    'Op': '..harness',
    'clean_env': '..harness',
    'cpu_probe': '..harness',
    'default_caches': 'runner',
    'parse_env': '..harness',
    'run_interleaved': '..harness',
    'thread_counts': '..harness',
    'timing': '..harness',
    'write_json': '..harness',
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = "kvz.benchmarks.harness" if mod == "..harness" else f"{__name__}.{mod}"
    return getattr(importlib.import_module(where), name)


def __dir__():
    return __all__
