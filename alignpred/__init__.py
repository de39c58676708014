"""kvz / AlignPred: error-bounded KV-cache compression."""
