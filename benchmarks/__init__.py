"""Benchmarks for kvz: baseline coders and rate-distortion sweeps."""
