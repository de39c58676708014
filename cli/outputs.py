"""Where ``kvz`` commands write: the check every output passes (:func:`check_output`) and the
output names of ``kvz decompress`` (:func:`decompress_outputs`). Imports nothing heavy."""
from __future__ import annotations

import os

import click

from alignpred.errors import OutputExistsError


def check_output(out: str, force: bool, inputs=()) -> None:
    """Refuse to overwrite an existing file without ``--force``, and ever to overwrite an input."""
    from alignpred.io import same_file

    for src in inputs:
        if same_file(out, src):
            raise OutputExistsError(f"{out} is also an input of this command; write the output elsewhere (-o)")
    if os.path.lexists(out) and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it, or choose another output with -o")


def decompress_outputs(srcs, out) -> list[str]:
    """The output path of each input of ``kvz decompress``."""
    def stem(src):
        return os.path.splitext(os.path.basename(src))[0] + ".safetensors"

    if len(srcs) == 1:
        if out and os.path.isdir(out):
            return [os.path.join(out, stem(srcs[0]))]
        return [out or os.path.splitext(srcs[0])[0] + ".safetensors"]
    if out is not None and not os.path.isdir(out):
        raise click.UsageError(f"with several inputs, -o must be an existing directory (got {out})")
    outs = [os.path.join(out, stem(s)) if out else os.path.splitext(s)[0] + ".safetensors" for s in srcs]
    seen: dict = {}
    for s, o in zip(srcs, outs):
        key = os.path.abspath(o)
        if key in seen:
            raise click.UsageError(f"{seen[key]} and {s} would both be written to {o}")
        seen[key] = s
    return outs
