"""Speed of kvz next to the coders a KV-cache store would otherwise use, in one run on real caches.

    python -m kvz.benchmarks.speed [--quick] [--json OUT.json] [--plot OUT.png] [--md OUT.md] [CACHES...]
    kvz bench --speed-only [--quick] --out OUT          (the same, into OUT/speed.{json,png,md})

What one run measures (defaults: ``data/eval/*.safetensors``, the 2,048-token held-out Gemma 3 270M
caches; ``--quick``: the first two, fewer repeats, a 4,096-token prefill):

1. **codecs, in process** - kvz encode (``compress``, tensor scope, eps 0.0267) and decode
   (``KvzReader.read()`` and ``read_into`` preallocated buffers) with 1, 2 and all threads (kvz's own
   ``threads=``), next to SZ3 (pysz, per-tensor absolute bound found by the baseline framework so every
   tensor's NRMSE <= eps, like kvz's tensor scope), FP8 e4m3 (ml_dtypes, per-tensor scale), zstd
   (level 3; level 19 decode, its encode timed once) and LMCache 0.5.6's ``AsymK16V8Codec`` (K kept
   in bf16, V in FP8 e4m3 with a per-tensor scale; pure PyTorch, run on the CPU with torch held to
   one intra-op thread). Every decoder produces the cache's own bf16 arrays. The baselines' "all
   threads" runs split the tensors (LMCache: the layers) over a thread pool of that size. Methods are
   *interleaved* (every round runs each method once, in a rotated order) and each figure is the median
   of its rounds, with the CPU time of the process next to the wall time (under load the CPU time is
   the steadier figure for one thread). Each timed op starts on warm cores (30 ms of GIL-free work on
   all of them first, untimed: a VM's core idle for ~0.1 s comes back slowly, which charged the
   multi-threaded ops for the single-threaded ones timed before them); one probe times kvz's
   multi-threaded decode after idle cores and after the warm-up, and the summary states both.
2. **kvz 0.1 side by side** - the last 0.1 commit (``d9e1fc2``, a git worktree at ``--kvz01``,
   created if absent) and this tree, each in a fresh subprocess (``PYTHONPATH`` = that tree), warmed
   on a bundled sample, then timed on the same caches: encode/decode values/s and bpv of both.
3. **CLI** - ``kvz decompress X.kvz -o Y.safetensors --force -q`` wall time vs the in-process read,
   with the process start included and excluded (start = ``kvz --help``), interleaved.
4. **environment** - this tree's worker under the default environment and with
   ``OPENBLAS_NUM_THREADS=1`` / ``OMP_NUM_THREADS=1``, interleaved; a default run slower by more than
   ``--env-tolerance`` is flagged.
5. **break-even bandwidth** of every decoder: ``B* = (size_raw - size_c) / t_decode``, the link speed
   below which loading the compressed file and decoding it beats loading raw bf16, by core count:
   measured at 1 and 2 threads (the codecs run on 1, 2 and all threads) and *projected* linearly to
   16 and 64 cores (decode time = 1-thread time / cores; an assumption, marked ``projected``).
6. **restore vs prefill** - a 16,384-token Gemma 3 270M cache is captured (the prefill, chunked as
   ``capture`` does, is timed), compressed, and restored with ``read_into`` (1 and all threads).
7. a cProfile of one single-thread decode, and bit-identity of decodes across thread counts and
   processes.
8. **entropy stage** - ns/symbol of kvz's rANS decode (``rans4``, the coder of its files) and of
   ``lanes32`` on the residual symbols of the first cache (:func:`.entropy_stage.real_objects`'s
   extraction and timing), next to published figures of other decoders (not measured here).
9. **one chunk** - ``KvzReader(threads=1 | 2).read(tokens=(a, b))`` of one 256-token object range
   (the middle chunk of the first cache): ms per chunk and the 2-thread speed-up.

Results: JSON (rows, machine, load, command), a plot (Agg) and a Markdown summary.

Separately, ``python -m kvz.benchmarks.speed.tree_compare --ref COMMIT`` (:mod:`.tree_compare`) runs
the same worker on this tree and on any other commit, alternating, and checks same speed and same
bytes (the restructure check against ``0e971f0``).

The package, one module per part: :mod:`.config` (settings), :mod:`.codecs` (what is timed),
:mod:`.codec_study` (1), :mod:`.processes` with :mod:`.worker` (2, 4), :mod:`.cli_study` with
:mod:`.cold_start` (3), :mod:`.restore` (6), :mod:`.profiling` (7), :mod:`.entropy_stage` (8),
:mod:`.one_chunk` (9), :mod:`.acceptance`,
:mod:`.report` and :mod:`.plot` (the outputs), :mod:`.runner` and :mod:`.main` (the run). Names are
loaded lazily, so the worker processes (``python -m kvz.benchmarks.speed.worker``) import only what
they measure.
"""
from __future__ import annotations

import importlib

# module (relative to this package) -> the names it gives the package
_MODULES = {
    '.config': ('BANK', 'BATCH_FILES', 'BLAS1', 'CHUNK_THREADS', 'CODECS', 'ENV_TOLERANCE', 'EPS', 'IDLE_S', 'KVZ01_COMMIT', 'KVZ01_DIR', 'PRESETS', 'PROJECTED_CORES', 'PUBLISHED_ENTROPY', 'SCHEMA', 'SCOPE', 'SECTIONS', 'WARM_S', 'log'),
    '.measures': ('arrays_digest', 'break_even', 'ns_per_symbol', 'projected_break_even'),
    '.codecs': ('BaselineCodec', 'KvzCodec', 'LMCacheCodec', 'lmcache_status', 'make_codecs'),
    '.codec_study': ('aggregate', 'by_cores', 'codec_section', 'decode_identity', 'idle_core_probe', 'make_row'),
    '.entropy_stage': ('entropy_section', 'entropy_timing', 'published_entropy', 'spaced'),
    '.one_chunk': ('chunk_range', 'chunk_section'),
    '.processes': ('ensure_kvz01', 'run_worker', 'summarize_env', 'summarize_versions', 'version_env_section'),
    '.cli_study': ('cli_section', 'kvz_command'),
    '.restore': ('long_text', 'restore_section'),
    '.profiling': ('bound_section', 'map_shapes', 'profile_decode'),
    '.acceptance': ('acceptance', 'agg_row'),
    '.report': ('markdown',),
    '.plot': ('write_plot',),
    '.runner': ('default_caches', 'machine', 'print_acceptance', 'render', 'run'),
    '.main': ('main',),
    '..harness': ('Op', 'clean_env', 'cpu_probe', 'parse_env', 'run_interleaved', 'thread_counts', 'timing', 'write_json'),
}
_WHERE = {name: mod for mod, names in _MODULES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """The package's names, each imported from its module on first use."""
    try:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return __all__
