"""kvz: the product namespace. ``import kvz`` gives the library API of :mod:`alignpred` (lazily);
the command line, integrations and benchmarks install as ``kvz.cli``, ``kvz.integrations`` and
``kvz.benchmarks`` (the repository's ``cli/``, ``integrations/`` and ``benchmarks/`` folders)."""
import alignpred as _alignpred
from alignpred import __all__, __version__  # noqa: F401


def __getattr__(name: str):
    return getattr(_alignpred, name)
