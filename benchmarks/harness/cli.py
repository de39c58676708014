"""The command line every benchmark shares: one argparse builder for the common flags (``--quick``,
``--json OUT``, ``--out``, ``-q``, cache paths) and the command line as it is recorded in results."""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from .paths import ROOT


def parser(doc: str | None, *, caches: str | None = None, quick: str | None = None, json: str | None = None,
           json_default=None, out: str | None = None, out_default=None, quiet: bool = False,
           prog: str | None = None) -> argparse.ArgumentParser:
    """An :class:`argparse.ArgumentParser` described by the first paragraph of ``doc`` (the module
    docstring, shown whole as the epilog), with the common flags whose help text is given:
    ``caches`` (positional cache paths), ``quick`` (``--quick``), ``json`` (``--json OUT``), ``out``
    (``--out``), ``quiet`` (``-q/--quiet``)."""
    doc = doc or ""
    ap = argparse.ArgumentParser(prog=prog or running_module(), description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if caches is not None:
        ap.add_argument("caches", nargs="*", help=caches)
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    if json is not None:
        ap.add_argument("--json", default=json_default, metavar="OUT", help=json)
    if out is not None:
        ap.add_argument("--out", default=out_default, help=out)
    if quiet:
        ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    return ap


def module_name(parts) -> str:
    """The name ``python -m`` runs a benchmark by: ``kvz.benchmarks.X`` (installed), or
    ``benchmarks.studies.Q.X`` for a study (not installed: run from the repository root)."""
    parts = list(parts)
    return ".".join(["benchmarks", *parts] if parts and parts[0] == "studies" else ["kvz", "benchmarks", *parts])


def running_module() -> str | None:
    """``python -m kvz.benchmarks.X`` (``benchmarks.studies.Q.X``) when this process runs a benchmark
    module (else None: argparse's default)."""
    path = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    folder = os.path.join(ROOT, "benchmarks") + os.sep
    if not (path.startswith(folder) and path.endswith(".py")):
        return None
    parts = os.path.relpath(path[:-3], folder).split(os.sep)
    if parts[-1] == "__main__":
        parts = parts[:-1]
    return " ".join(["python", "-m", module_name(parts)])


def command_line(module: str, argv=None) -> str:
    """``python -m kvz.benchmarks.<module> ARGS`` as typed (``argv`` default: this process's); a
    study's ``module`` is ``studies.<question>.<name>``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module_name(module.split(".")), *(shlex.quote(str(x)) for x in args)])


def run_study(ap: argparse.ArgumentParser, run, markdown, module: str, argv=None, *, json_default=None,
              args=None, out: str = "json", md: bool = True, indent=None) -> dict:
    """What a study's ``main`` does: parse ``argv`` (or take ``args``, parsed already), ``result = run(args)``
    (``args.command``: the command line; ``args.error``: the parser's), write ``result`` to the path in
    ``args.<out>`` (``json_default`` when not given) and, with ``md``, ``markdown(result)`` next to it as
    ``.md``; print the Markdown; the result."""
    from .output import write_json, write_text

    args = ap.parse_args(argv) if args is None else args
    args.command, args.error = command_line(module, argv), ap.error
    result = run(args)
    path = getattr(args, out, None) or json_default
    text = markdown(result)
    if path:
        write_json(result, path, **({} if indent is None else {"indent": indent}))
        if md:
            write_text(os.path.splitext(path)[0] + ".md", text)
    print(text)
    return result
