"""The documentation points inside the repository, and the acceptance run never switches data
sets behind the user's back."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


@pytest.mark.parametrize("doc", ["README.md", "format_spec/README.md", "samples/README.md", "benchmarks/RESULTS.md",
                                 "benchmarks/README.md", *DOCS])
def test_relative_links_stay_in_the_repository(doc):
    path = os.path.join(ROOT, doc)
    text = open(path, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" in target:
            continue
        full = os.path.normpath(os.path.join(os.path.dirname(path), target))
        assert full.startswith(ROOT + os.sep), f"{doc} links outside the repository: {target}"
        assert os.path.exists(full), f"{doc} links to a missing file: {target}"


def test_acceptance_refuses_a_missing_data_set(monkeypatch, capsys):
    from benchmarks.studies.rate import acceptance

    monkeypatch.setattr("glob.glob", lambda *a, **k: [])
    # as a script it pins the thread variables for itself; inside the test run that would leak
    # NUMBA_NUM_THREADS=1 into every later numba compile
    monkeypatch.setattr(acceptance, "pin_threads", lambda n: None)
    with pytest.raises(SystemExit):
        acceptance.main([])
    assert "make_samples.py --what eval" in capsys.readouterr().err


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/RESULTS.md", "benchmarks/results/quality-20prompts.md",
                                 "format_spec/README.md", *DOCS])
def test_docs_name_no_bank_file_that_does_not_exist(doc):
    """Every ``*.h5`` path a document names exists (issue 16: results named a bank that had moved)."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    for path in re.findall(r"`([\w./-]+\.h5)`", text):
        if "/" in path and not path.startswith(("~", "/", "path/", "caches/")):
            assert os.path.exists(os.path.join(ROOT, path)), f"{doc} names {path}, which does not exist"


def test_the_eps_table_is_the_measured_one():
    """The README's 'Choosing eps' rows are benchmarks/results/eps_table.json (bits/value, mean KL, identical share)."""
    import json

    res = json.load(open(os.path.join(ROOT, "benchmarks", "results", "eps_table.json"), encoding="utf-8"))["settings"]
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Choosing eps", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (bf16|kvz `[^`]+`|fp8 e4m3)[^|]* \| ([\d.]+) \| ([\d.e+-]+) \| (\d+)% ", section, re.M)
    assert len(rows) == len(res) >= 8
    for label, bpv, kl, same in rows:
        label = label.replace("`", "")
        name = label if label in res else next(n for n in res if n.startswith(label))
        s = res[name]
        assert (float(bpv), float(kl), int(same)) == (round(s["bpv"], 2), float(f"{s['kl_mean']:.2e}"),
                                                      round(100 * s["identical_frac"])), name


def test_the_readme_is_the_front_door():
    """Issue 41, item 6: at most 300 lines, two set-up commands (install, run the tests), and a link to
    every docs page."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) <= 300
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", setup, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.splitlines() if line.strip()] == [
        'python -m pip install -e ".[test,bench,model,store]"', "python -m pytest -q"]
    missing = [d for d in DOCS if f"]({d})" not in text]
    assert not missing, f"the README links no {missing}"


def test_study_commands_in_the_docs_name_modules_that_exist():
    """Every ``python -m benchmarks.studies...`` and ``python -m kvz.benchmarks...`` a page names is a module
    (or package) of ``benchmarks/``."""
    bad = []
    for doc in ["README.md", "benchmarks/README.md", "format_spec/README.md", *DOCS]:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for mod in re.findall(r"python -m ((?:kvz\.)?benchmarks\.[\w.]+)", text):
            parts = mod.removeprefix("kvz.").split(".")
            path = os.path.join(ROOT, *parts)
            if not (os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py"))):
                bad.append(f"{doc}: {mod}")
    assert not bad, "\n".join(bad)


# the folders of the repository a docstring may name files in
_TOP = ("alignpred", "cli", "integrations", "benchmarks", "tests", "format_spec", "docs", "samples", "kvz", ".ci")
# pages named before they are committed (remove an entry when its page lands)
_PENDING = {"docs/engine-scope.md"}


def _named_files(text: str):
    """Repository paths of ``.py`` / ``.md`` / ``.c`` / ``.sh`` files a text names (globs, templates and
    the generated ``benchmarks/results/`` left out)."""
    pat = r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in _TOP) + r")/[\w./-]*\.(?:py|md|c|sh))\b"
    for m in re.findall(pat, text):
        if not m.startswith("benchmarks/results/"):
            yield m


def test_docstrings_name_no_file_that_does_not_exist():
    """Issue 41, item 6: every repository file a docstring of the library, the CLI, the integrations or the
    benchmarks (studies included) names exists."""
    import ast

    bad = []
    for folder in ("alignpred", "cli", "integrations", "benchmarks", "kvz"):
        for here, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(here, f)
                tree = ast.parse(open(path, encoding="utf-8").read())
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        for name in _named_files(ast.get_docstring(node, clean=False) or ""):
                            if not os.path.exists(os.path.join(ROOT, name)) and name not in _PENDING:
                                bad.append(f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', 1)}: {name}")
    assert not bad, "\n".join(bad)
