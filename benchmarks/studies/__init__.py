"""The studies: measurements behind a design decision or a number in the docs, grouped by the
question they answer. They are **not installed** (the installed benchmarks are ``kvz.benchmarks``:
``kvz bench``, the speed, rate-quality, reuse and engine benchmarks); run them from the repository
root, where ``benchmarks`` is importable:

    python -m benchmarks.studies.rate.eps_table --prompts 12 --new-tokens 32
    python -m benchmarks.studies.speed.entropy_decode --study lanes

* :mod:`.rate` - how many bits for which error or quality (eps table, scopes, lossless, calibration
  size, sensitivity, attention gain, a second model);
* :mod:`.speed` - where decode time goes and what would buy it (kernels, AMX, entropy decode, map
  rank and sources, chunk loading, start-up);
* :mod:`.serving` - serving from compressed KV (draft on the coarse tier, verify on the exact one);
* :mod:`.robustness` - damaged files (the single-byte corruption sweep).

Every study has the same two entry points, ``run(args) -> dict`` (the measurement; ``args`` as its
``main`` parses them) and ``markdown(result) -> str`` (the report of a result), and a ``main(argv)``
that parses, runs, writes ``--json`` (and the ``.md`` beside it) and prints the report. They import
the installed harness (``kvz.benchmarks.harness``) and write to ``benchmarks/results/``.
"""
