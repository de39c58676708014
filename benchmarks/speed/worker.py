"""One fresh-process measurement of a kvz tree (section 2 and 4): ``python -m kvz.benchmarks.speed.worker
ARGS_JSON`` with ``PYTHONPATH`` = the tree whose ``alignpred`` is measured (this tree or kvz 0.1).

It warms up on a small sample, then times ``compress`` to a file and ``KvzReader(...).read()`` with
each thread count, and prints one line ``KVZ-SPEED-RESULT {json}``: times per thread count, bpv,
digests of the decodes and the worst tensor NRMSE. It uses only what kvz 0.1 had as well (the
``threads=`` keywords are passed where the tree's signatures take them, and the budget as the loose
``eps=`` / ``scope=`` where ``compress`` takes those, as one ``budget=`` otherwise)."""
from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import time


def _timed(fn, repeats: int) -> tuple[dict, object]:
    walls, cpus, last = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        last = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {"wall": walls, "cpu": cpus}, last


def measure(a: dict) -> dict:
    """The measurement of ``a`` (cache, bank, warm, threads, rep_enc, rep_dec, eps, scope)."""
    t0 = time.perf_counter()
    import numpy as np

    import alignpred
    from alignpred import Bank, KvzReader, compress, load_cache
    import_s = time.perf_counter() - t0
    from .measures import arrays_digest
    bank = Bank.load(a["bank"])
    cs, rs = inspect.signature(compress).parameters, inspect.signature(KvzReader).parameters
    if "eps" in cs:  # kvz 0.1 (and the trees before issue 41): the loose eps / scope keywords
        budget_kw = {"eps": a["eps"], "scope": a["scope"]}
    else:
        from alignpred import ErrorBudget

        budget_kw = {"budget": ErrorBudget(eps=a["eps"], scope=a["scope"])}

    def enc(cache, path, th):
        if os.path.exists(path):
            os.remove(path)
        kw = {"threads": th} if ("threads" in cs and th) else {}
        return compress(cache, path, bank=bank, **budget_kw, **kw)

    def dec(path, th):
        kw = {"threads": th} if ("threads" in rs and th) else {}
        return KvzReader(path, bank=bank, **kw).read()

    tmp = tempfile.mkdtemp(prefix="kvz-speed-")
    path = os.path.join(tmp, "x.kvz")
    t0 = time.perf_counter()
    w = load_cache(a["warm"])
    enc(w, path, None)
    dec(path, None)
    warm_s = time.perf_counter() - t0
    cache = load_cache(a["cache"])
    n = cache.layout.n_values
    out = {"version": alignpred.__version__, "module": alignpred.__file__, "import_s": import_s, "warm_s": warm_s,
           "n_values": n, "threads_param": {"compress": "threads" in cs, "reader": "threads" in rs},
           "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "PYTHONPATH")},
           "encode": {}, "decode": {}, "digest": {}}
    for th in a["threads"]:
        out["encode"][str(th)], _ = _timed(lambda th=th: enc(cache, path, th), a["rep_enc"])
    out["file_bytes"] = os.path.getsize(path)
    out["bpv"] = 8.0 * out["file_bytes"] / n
    d: dict = {}
    for th in a["threads"]:
        out["decode"][str(th)], d = _timed(lambda th=th: dec(path, th), a["rep_dec"])
        out["digest"][str(th)] = arrays_digest(d)
    worst = 0.0
    for k, x in cache.tensors.items():
        x = np.asarray(x, np.float64)
        e = float(np.sum((np.asarray(d[k], np.float64) - x) ** 2))
        nn = float(np.sum(x * x))
        worst = max(worst, (e / nn) ** 0.5 if nn else 0.0)
    out["nrmse_max_tensor"] = worst
    os.remove(path)
    os.rmdir(tmp)
    return out


def main(argv=None) -> None:
    from .config import RESULT_TAG

    args = sys.argv[1:] if argv is None else argv
    print(RESULT_TAG + json.dumps(measure(json.loads(args[0]))))


if __name__ == "__main__":
    main()
