"""Benchmarks for kvz (installed as ``kvz.benchmarks``), each run with ``python -m kvz.benchmarks.<name>``.

* :mod:`.harness` - what every benchmark shares: paths and cache discovery, machine description and
  thread limits, interleaved timing with a CPU probe, JSON/Markdown/plot writing, the common flags;
* :mod:`.baselines` - the other coders behind one contract (:class:`~.baselines.TensorCodec`);
* rate and error: :mod:`.run` (``kvz bench``) with :mod:`.report`, :mod:`.lossless`,
  :mod:`.acceptance`, :mod:`.map_sources`, :mod:`.corruption_sweep`;
* speed: :mod:`.speed` (a package: one module per study), :mod:`.kernels_bench`,
  :mod:`.bench_entropy`, :mod:`.loader`;
* downstream quality (needs torch + transformers): :mod:`.lm` (the model side) and :mod:`.prompts`,
  :mod:`.quality`, :mod:`.rate_quality` with :mod:`.rate_methods` and :mod:`.rate_report`,
  :mod:`.sensitivity`, :mod:`.verify`, :mod:`.reuse`.

Results that are committed live in ``benchmarks/results/``.
"""
