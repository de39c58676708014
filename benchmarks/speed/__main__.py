"""``python -m kvz.benchmarks.speed``."""
from .main import main

main()
