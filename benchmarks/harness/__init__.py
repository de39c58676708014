"""The benchmark harness: what every benchmark in ``kvz.benchmarks`` shares.

* :mod:`.paths` - the repository root, samples, held-out/calibration caches, results folder, the
  bundled bank (through :func:`alignpred.bank.resolve_bank`), cache discovery, display paths;
* :mod:`.machine` - machine description, load, code revision, thread counts and limits, child
  environments;
* :mod:`.timing` - interleaved rounds with wall and CPU medians, a thread pool, a CPU probe;
* :mod:`.output` - JSON / Markdown / plot writing;
* :mod:`.cli` - the common command-line flags, and :func:`run_study` (a study's ``main``);
* :mod:`.native` - builds the C probes of ``benchmarks/native/``.

Importing the harness loads neither numpy nor numba, so a benchmark can pin its threads
(:func:`pin_threads`) after importing it.
"""
from .cli import command_line, parser, run_study
from .machine import (
    THREAD_VARS,
    all_threads,
    clean_env,
    code_revision,
    cpu_name,
    limit_threads,
    loadavg,
    machine_info,
    package_versions,
    parse_env,
    pin_threads,
    thread_counts,
)
from .output import json_default, pyplot, read_json, save_figure, write_json, write_text
from .paths import (
    BANK_NAME,
    CALIB_DIR,
    EVAL_DIR,
    NO_EVAL,
    RESULTS,
    ROOT,
    SAMPLES,
    TEXTS,
    WARM_SAMPLE,
    bank_file,
    bundled_bank,
    caches_in,
    default_caches,
    display_path,
    eval_caches,
    resolve_bank,
    sample_caches,
    stem,
)
from .timing import Op, children_cpu, cpu_probe, median, median_time, pmap, run_interleaved, timing, warm_cores

__all__ = ["BANK_NAME", "CALIB_DIR", "EVAL_DIR", "NO_EVAL", "Op", "RESULTS", "ROOT", "SAMPLES", "TEXTS",
           "THREAD_VARS", "WARM_SAMPLE", "all_threads", "bank_file", "bundled_bank", "caches_in", "children_cpu",
           "clean_env", "code_revision", "command_line", "cpu_name", "cpu_probe", "default_caches", "display_path",
           "eval_caches", "json_default", "limit_threads", "loadavg", "machine_info", "median", "median_time",
           "package_versions", "parse_env", "parser", "pin_threads", "pmap", "pyplot", "read_json", "resolve_bank", "run_interleaved", "run_study",
           "sample_caches", "save_figure", "stem", "thread_counts", "timing", "warm_cores", "write_json", "write_text"]
