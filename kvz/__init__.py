"""kvz: the product namespace. ``import kvz`` gives the library API of :mod:`alignpred`; the
command line, integrations and benchmarks install as ``kvz.cli``, ``kvz.integrations`` and
``kvz.benchmarks`` (the repository's ``cli/``, ``integrations/`` and ``benchmarks/`` folders)."""
from alignpred import *  # noqa: F401,F403
from alignpred import __all__, __version__  # noqa: F401
