"""`kvz calibrate` takes cache files or --model M --texts DIR (issue 16); mixing them, or a model
option without --model, is a one-line usage error before anything is loaded."""
from __future__ import annotations

from click.testing import CliRunner

from kvz.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, ["calibrate", *args])


def test_model_route_reports_bad_input_in_one_line(tmp_path):
    r = _run("--model", str(tmp_path / "missing.gguf"), "--texts", str(tmp_path), "-o", str(tmp_path / "b.h5"), "-q")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "b.h5").exists()


def test_caches_or_model_not_both_and_model_options_need_model(tmp_path):
    c = tmp_path / "c.safetensors"
    c.write_bytes(b"")
    r = _run(str(c), "--model", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "b.h5"))
    assert r.exit_code == 2 and "not both" in r.output
    r = _run(str(c), "--texts", str(tmp_path), "-o", str(tmp_path / "b.h5"))
    assert r.exit_code == 2 and "go with --model" in r.output
    r = _run("-o", str(tmp_path / "b.h5"))
    assert r.exit_code == 2 and "--model M --texts DIR" in r.output
