"""--target-kl with a bank given by path: its sensitivity record beside the bank file
(``<bank stem>.sensitivity.json``, as ``kvz calibrate --model`` writes it) is found without
registering the bank."""
import json

import pytest
from click.testing import CliRunner
from kvz_testing import synthetic_cache

from alignpred import ErrorBudget, KvzError, compress_bytes, fit_bank, save_cache
from kvz.cli.main import cli


def _bank_with_record(tmp_path, record=True, seed=0):
    c = synthetic_cache(T=300, roped=True, seed=seed)
    src = tmp_path / "c.safetensors"
    save_cache(src, c.tensors, c.metadata)
    d = tmp_path / "banks"
    d.mkdir()
    bank = fit_bank([c], rank=8)
    bank.save(d / "mine.h5")
    if record:
        weights = {n: (4.0 if n.endswith("key") else 1.0) for n in c.tensors}
        (d / "mine.sensitivity.json").write_text(json.dumps(
            {"bank_id": bank.id, "model": bank.model, "tensor_weights": weights,
             "kl_per_nrmse2": sum(weights.values())}))
    return c, src, d / "mine.h5"


def test_target_kl_finds_the_record_beside_a_bank_given_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVZ_BANK_PATH", str(tmp_path / "empty-registry"))
    c, src, bank = _bank_with_record(tmp_path)
    r = CliRunner().invoke(cli, ["compress", str(src), "--bank", str(bank), "--target-kl", "1e-3",
                                 "-o", str(tmp_path / "x.kvz"), "--json", "-q"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    # eps = sqrt(KL / sum of weights): sum = 3 keys x 4 + 3 values x 1 = 15
    assert info["eps"] == pytest.approx((1e-3 / 15) ** 0.5, rel=1e-6)
    blob = compress_bytes(c, bank=str(bank), budget=ErrorBudget(target_kl=1e-3))  # the Python API by path too
    assert len(blob) > 0


def test_no_record_beside_the_bank_is_still_the_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVZ_BANK_PATH", str(tmp_path / "empty-registry"))
    c, src, bank = _bank_with_record(tmp_path, record=False, seed=1)  # another bank id
    r = CliRunner().invoke(cli, ["compress", str(src), "--bank", str(bank), "--target-kl", "1e-3",
                                 "-o", str(tmp_path / "x.kvz")])
    assert r.exit_code != 0 and "sensitivity" in r.output and "Traceback" not in r.output
    with pytest.raises(KvzError, match="sensitivity"):
        compress_bytes(c, bank=str(bank), budget=ErrorBudget(target_kl=1e-3))


def test_target_kl_takes_fp8_as_the_engines_do(tmp_path, monkeypatch):
    """``--target-kl fp8`` is FP8's KL (as the engines' ``target_kl="fp8"``); a bad value is a usage error."""
    from alignpred.codec.budget import FP8_KL

    monkeypatch.setenv("KVZ_BANK_PATH", str(tmp_path / "empty-registry"))
    c, src, bank = _bank_with_record(tmp_path)
    out = tmp_path / "fp8.kvz"
    r = CliRunner().invoke(cli, ["compress", str(src), "--bank", str(bank), "--target-kl", "FP8", "-o", str(out),
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{"):])["target_kl"] == FP8_KL
    for bad in ("bogus", "-1", "0"):
        r = CliRunner().invoke(cli, ["compress", str(src), "--bank", str(bank), "--target-kl", bad,
                                     "-o", str(tmp_path / "bad.kvz")])
        assert r.exit_code == 2 and "--target-kl" in r.output and "Traceback" not in r.output
        assert not (tmp_path / "bad.kvz").exists()
