"""Writing results: JSON (numpy scalars, sets and tuples made plain; written atomically), Markdown
text, and a matplotlib figure on the Agg backend."""
from __future__ import annotations

import json
import os


def json_default(o):
    """``json.dump(default=...)`` for numpy scalars, numpy booleans, sets, tuples, and other scalars with
    ``.item()`` (one-element torch tensors)."""
    import numpy as np

    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    if callable(getattr(o, "item", None)):
        return o.item()
    raise TypeError(type(o))


def write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (its folder made if absent)."""
    from alignpred import atomic_write

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, [text.encode("utf-8")])


def write_json(obj, path, indent: int = 1) -> None:
    """``obj`` as JSON at ``path`` (atomically, a final newline)."""
    write_text(path, json.dumps(obj, indent=indent, default=json_default) + "\n")


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 110) -> None:
    """Save ``fig`` at ``path`` (its folder made if absent) and close it."""
    plt = pyplot()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
