"""Section 3: ``kvz decompress`` in a fresh process against the in-process read of the same file,
interleaved; process start measured as ``kvz --help``; a batch of files in one call; where a cold
process spends its time (:mod:`.cold_start`)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from ..harness import Op, all_threads, children_cpu, clean_env, median, run_interleaved, timing
from .config import BATCH_FILES, EPS, SCOPE, log
from .processes import result_line


def kvz_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvz")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-c", "import sys; from kvz.cli.main import main; sys.argv[0] = 'kvz'; main()"]


def cli_section(cache, bank, *, rounds: int = 3, eps: float = EPS, progress: bool = True) -> dict:
    """``kvz decompress`` (a fresh process, default threads) vs the in-process read of the same file,
    interleaved; process start measured as ``kvz --help`` (interpreter + kvz's imports)."""
    from alignpred import ErrorBudget, KvzReader, compress

    tmp = tempfile.mkdtemp(prefix="kvz-speed-cli-")
    src = os.path.join(tmp, "cache.kvz")
    dst = os.path.join(tmp, "out.safetensors")
    info = compress(cache, src, budget=ErrorBudget(eps=eps, scope=SCOPE), bank=bank)
    n = cache.layout.n_values
    cmd = kvz_command()
    env = clean_env(pythonpath=os.environ.get("PYTHONPATH"))

    def sub(args):
        def fn():
            p = subprocess.run(cmd + args, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd + args)} failed: {p.stderr[-1000:]}")
        return fn

    bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
    phases: list[dict] = []

    def cold():
        p = subprocess.run([sys.executable, "-m", "kvz.benchmarks.speed.cold_start",
                            json.dumps({"src": src, "dst": dst + ".cold"})],
                           capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
        phases.append(result_line(p, "cold-start breakdown"))

    batch_dir = os.path.join(tmp, "batch")
    os.mkdir(batch_dir)
    batch = []
    for i in range(BATCH_FILES):  # copies of one file: a batch of equal work
        batch.append(os.path.join(tmp, f"cache{i}.kvz"))
        shutil.copyfile(src, batch[-1])
    KvzReader(src, bank=bank).read()  # warm
    sub(["decompress", src, "-o", dst, "--force", "-q"])()  # warm (numba cache, page cache)
    ops = [Op("kvz decompress (CLI)", "decode", 0, sub(["decompress", src, "-o", dst, "--force", "-q"])),
           Op(f"kvz decompress, {BATCH_FILES} files in one call", "decode", 0,
              sub(["decompress", *batch, "-o", batch_dir, "--force", "-q"])),
           Op("kvz --help (process start)", "start", 0, sub(["--help"])),
           Op("python -c pass (interpreter)", "start", 0, lambda: subprocess.run([sys.executable, "-c", "pass"],
                                                                              env=env, cwd=tmp, check=True)),
           Op("cold-start breakdown (python -c ...)", "decode", 0, cold),
           Op("in-process read()", "decode", all_threads(), lambda: KvzReader(src, bank=bank).read()),
           Op("in-process read_into()", "decode", all_threads(), lambda: KvzReader(src, bank=bank).read_into(bufs)),
           Op("in-process decompress_to()", "decode", all_threads(),
              lambda: KvzReader(src, bank=bank).decompress_to(dst))]
    k0 = children_cpu()
    run_interleaved(ops, rounds, label="cli" if progress else "", log=log)
    k1 = children_cpu()
    t = {o.codec: median(o.walls) for o in ops}
    cli, start, inproc = t["kvz decompress (CLI)"], t["kvz --help (process start)"], t["in-process read()"]
    res = {"file_bytes": info.file_bytes, "n_values": n, "command": " ".join(shlex.quote(x) for x in
                                                                          ["kvz", "decompress", "X.kvz", "-o",
                                                                           "Y.safetensors", "--force", "-q"]),
           "executable": cmd[0], "rounds": rounds,
           "times": {o.codec: timing(o.walls, o.cpus) for o in ops},
           "children_cpu_s": k1 - k0,
           "cli_vps": n / cli, "cli_vps_excl_start": n / max(cli - start, 1e-9), "inproc_read_vps": n / inproc,
           "inproc_read_into_vps": n / t["in-process read_into()"],
           "inproc_decompress_to_vps": n / t["in-process decompress_to()"]}
    res["cold_start_phases"] = {k: median([p[k] for p in phases]) for k in phases[0]} if phases else {}
    res["ratio_incl_start"] = res["cli_vps"] / res["inproc_read_vps"]
    res["ratio_excl_start"] = res["cli_vps_excl_start"] / res["inproc_read_vps"]
    res["batch_files"] = BATCH_FILES
    res["cli_batch_vps"] = BATCH_FILES * n / t[f"kvz decompress, {BATCH_FILES} files in one call"]
    res["ratio_batch"] = res["cli_batch_vps"] / res["inproc_read_vps"]
    shutil.rmtree(tmp, ignore_errors=True)
    return res
