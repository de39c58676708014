"""The RAG accuracy benchmark's parts (:mod:`kvz.benchmarks.rag_accuracy` runs them): the questions
(:mod:`.tasks`: documents from real text, planted facts, prompts, MuSiQue) and their scoring
(:mod:`.scoring`: SQuAD exact match and token F1, the paired bootstrap)."""
