"""The repository's habits (issue 41, item 7): the commit-msg hook keeps subjects at 72 characters
at most, and mypy's ``files`` reach the CLI and the integrations under their installed names."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / ".githooks" / "commit-msg"


def _hook(tmp_path, message: str) -> subprocess.CompletedProcess:
    f = tmp_path / "COMMIT_EDITMSG"
    f.write_text(message, encoding="utf-8")
    return subprocess.run([sys.executable, str(HOOK), str(f)], capture_output=True, text=True, timeout=60)


GOOD = "x" * 72
BAD = "x" * 73


@pytest.mark.parametrize("message", [
    f"{GOOD}\n\nA body line may be as long as it likes: {'y' * 100}\n",
    f"\n\n# a comment line {'z' * 90}\n{GOOD}\n",
    "One of each: alignpred.nrmse — é, ü and ✓ count as one character each\n",
])
def test_hook_accepts(tmp_path, message):
    r = _hook(tmp_path, message)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("message", [
    f"{BAD}\n\nbody\n",
    f"# comment\n\n{BAD}",
    f"{'w' * 50}\n{'v' * 30}\n\nbody: the subject is the first paragraph, as git log %s shows it\n",
])
def test_hook_rejects(tmp_path, message):
    r = _hook(tmp_path, message)
    assert r.returncode == 1
    assert "at most 72" in r.stderr


def test_hook_is_executable():
    assert os.access(HOOK, os.X_OK)
    assert HOOK.read_text().startswith("#!/usr/bin/env python3\n")


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_git_runs_the_hook(tmp_path):
    """In a scratch repository with ``core.hooksPath`` set as CONTRIBUTING.md says, git refuses
    a long subject and takes a short one."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": str(tmp_path)}

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path / "r", capture_output=True, text=True, env=env, timeout=60)

    (tmp_path / "r").mkdir()
    git("init", "-q")
    git("config", "core.hooksPath", str(HOOK.parent))
    (tmp_path / "r" / "f").write_text("1")
    git("add", "f")
    bad = git("commit", "-q", "-m", BAD)
    assert bad.returncode != 0 and "at most 72" in bad.stderr
    good = git("commit", "-q", "-m", GOOD, "-m", "measurements in the body")
    assert good.returncode == 0, good.stderr


def test_mypy_checks_cli_and_integrations():
    """mypy's ``files`` reach cli/ and integrations/ as ``kvz.cli`` / ``kvz.integrations`` (their
    installed names, through the links in .typecheck/kvz; mypy cannot follow setuptools'
    package-dir mapping), so their imports of each other resolve."""
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    tree = ROOT / ".typecheck" / "kvz"
    assert ".typecheck/kvz" in files and "alignpred" in files
    assert (tree / "__init__.py").resolve() == (ROOT / "kvz" / "__init__.py").resolve()
    for name in ("cli", "integrations"):
        assert (tree / name).resolve() == (ROOT / name).resolve(), name
