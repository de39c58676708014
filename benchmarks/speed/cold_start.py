"""Where a fresh ``kvz decompress`` process spends its time (section 3): ``python -m
kvz.benchmarks.speed.cold_start ARGS_JSON`` imports what ``kvz`` imports, loads the compiled kernels,
opens the file, builds the bank and plans, and decompresses it twice (cold, then warm); prints
``KVZ-SPEED-RESULT {json}`` with the seconds of each phase. Not in it: the interpreter's start
(``python -c pass``) and the process exit, which ``kvz`` itself makes cheap (``kvz.cli.startup.
exit_process``: no teardown of numba's objects) -- time ``kvz decompress`` itself for those. The
integer weights of the maps are prepared at first use, so they count in ``first_decompress_s``."""
from __future__ import annotations

import json
import sys
import time


def phases(src: str, dst: str) -> dict:
    t0 = time.perf_counter()
    from alignpred import KvzReader
    from kvz.cli.main import skip_numba_blas_probe  # what `kvz` imports
    t1 = time.perf_counter()
    skip_numba_blas_probe()  # what kvz does before its first kernel load
    import numpy as np

    from alignpred.kernels import quantize_rows
    quantize_rows(np.ones((1, 2), np.float32))  # numba's one-time set-up (first kernel load in a process)
    tn = time.perf_counter()
    r = KvzReader(src)
    t2 = time.perf_counter()
    r.decoder  # noqa: B018  (the bank and the plans)
    t3 = time.perf_counter()
    r.decompress_to(dst)
    t4 = time.perf_counter()
    r.decompress_to(dst)
    t5 = time.perf_counter()
    return {"import_s": t1 - t0, "numba_setup_s": tn - t1, "open_s": t2 - tn, "bank_and_plans_s": t3 - t2,
            "first_decompress_s": t4 - t3, "second_decompress_s": t5 - t4}


def main(argv=None) -> None:
    from .config import RESULT_TAG

    a = json.loads((sys.argv[1:] if argv is None else argv)[0])
    print(RESULT_TAG + json.dumps(phases(a["src"], a["dst"])))


if __name__ == "__main__":
    main()
