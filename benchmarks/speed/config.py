"""The speed benchmark's settings: error target, presets, the kvz 0.1 reference, the thread-variable
variants, and its progress log."""
from __future__ import annotations

import sys

EPS = 0.0267
SCOPE = "tensor"
BANK = "gemma-3-270m"
KVZ01_COMMIT = "d9e1fc2"
KVZ01_DIR = "/tmp/kvz01"
SCHEMA = "kvz-speed/1"
CODECS = ("kvz", "kvz-balanced", "kvz-fast", "sz3", "fp8_e4m3", "zstd-3", "zstd-19", "lmcache_k16v8")
SECTIONS = ("codecs", "entropy", "chunk", "profile", "bound", "processes", "cli", "restore")
CHUNK_THREADS = (1, 2)  # the one-chunk decode is timed on these thread counts
WARM_S = 0.03  # every timed in-process op starts after this long with all cores busy (harness.warm_cores)
IDLE_S = 0.15  # the idle-core probe: a decode after this long with the cores idle, vs after WARM_S busy
PROJECTED_CORES = (16, 64)  # break-even projected to these core counts: decode time = 1-thread time / cores
# published single-thread static-model entropy decoders (8-bit symbols; not measured here): (decoder, source, GiB/s)
PUBLISHED_ENTROPY = (
    ("32x64 lanes, 10-12-bit probabilities", "hypersonic-rANS", 3.0),
    ("15-bit probabilities", "hypersonic-rANS", 1.8),
    ("rans32x16, AVX2/AVX-512", "htscodecs", 2.3),
    ("Huff0", "zstd", 2.5),
)
BLAS1 = "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1"
BATCH_FILES = 8   # `kvz decompress` of this many files in one call (the start-up paid once)
ENV_TOLERANCE = 0.05  # a default-environment run more than 5 % slower than the single-thread-BLAS one is flagged
RESULT_TAG = "KVZ-SPEED-RESULT "  # the line a worker process prints its JSON result on

# the two presets; every count can be overridden on the command line
PRESETS = {
    "quick": {"n_caches": 2, "proc_caches": 1, "rounds": 3, "enc_rounds": 2, "proc_rounds": 1, "env_rounds": 2,
              "rep_enc": 1, "rep_dec": 2, "cli_rounds": 2, "prefill_tokens": 4096, "restore_repeats": 3,
              "env_variants": (BLAS1,), "chunk_rounds": 5, "entropy_objects": 24, "entropy_rounds": 3},
    "full": {"n_caches": 0, "proc_caches": 0, "rounds": 5, "enc_rounds": 3, "proc_rounds": 2, "env_rounds": 3,
             "rep_enc": 2, "rep_dec": 3, "cli_rounds": 3, "prefill_tokens": 16384, "restore_repeats": 5,
             "env_variants": ("OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=1", BLAS1), "chunk_rounds": 15,
             "entropy_objects": 0, "entropy_rounds": 10},
}

QUIET = {"on": False}  # -q: no progress lines


def log(msg: str) -> None:
    if not QUIET["on"]:
        print(f"[speed] {msg}", file=sys.stderr, flush=True)
