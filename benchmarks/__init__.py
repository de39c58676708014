"""Benchmarks for kvz (installed as ``kvz.benchmarks``), each run with ``python -m kvz.benchmarks.<name>``:
the benchmarks a user runs to check a claim of the docs.

* :mod:`.harness` - what every benchmark shares: paths and cache discovery, machine description and
  thread limits, interleaved timing with a CPU probe, JSON/Markdown/plot writing, the common flags,
  the C probes' build;
* :mod:`.baselines` - the other coders behind one contract (:class:`~.baselines.TensorCodec`);
* rate-distortion: :mod:`.run` (``kvz bench``) with :mod:`.report`;
* speed: :mod:`.speed` (``kvz bench --speed``; a package, one module per section);
* downstream quality (needs torch + transformers): :mod:`.lm` (the model side), :mod:`.prompts`,
  :mod:`.quality`, :mod:`.rate_quality` (``kvz bench --quality``) with :mod:`.rate_methods` and
  :mod:`.rate_report`;
* reuse and engines: :mod:`.reuse`, :mod:`.reuse_repair`, :mod:`.engines`, :mod:`.vllm_reuse`,
  :mod:`.vllm_hit`, :mod:`.vllm_ttft` (with :mod:`.link_proxy`), :mod:`.hit_model`, :mod:`.store_soak`,
  :mod:`.gpu_decode`, :mod:`.rag_accuracy`.

The studies behind the design (not installed) are in ``benchmarks/studies/``, by question: ``rate``,
``speed``, ``serving``, ``robustness``; run them from the repository root
(``python -m benchmarks.studies.rate.eps_table``). Results that are committed live in ``benchmarks/results/``.
"""
