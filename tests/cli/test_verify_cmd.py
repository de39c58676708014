"""`kvz verify` / `inspect --verify` and the smaller defects of issue 16, each with a test."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from kvz_testing import synthetic_cache

from alignpred import (
    BankMismatchError,
    Cache,
    EncodeError,
    ErrorBudget,
    KvzError,
    compress_bytes,
    fit_bank,
    load_cache,
    save_cache,
)
from alignpred.codec import Profile
from kvz.cli.main import cli


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    c = synthetic_cache(n_layers=2, T=300, d=16)
    bank = fit_bank([c], rank=4, rotations=False)
    good = d / "good.kvz"
    good.write_bytes(compress_bytes(c, budget=ErrorBudget(eps=0.05, lossless=True), bank=bank, profile=Profile(embed_bank=True)))
    bad = bytearray(good.read_bytes())
    bad[200] ^= 0x04  # inside the first payload
    (d / "bad.kvz").write_bytes(bytes(bad))
    return d


def test_verify_passes_a_good_file_and_decodes_every_tier(files):
    res = CliRunner().invoke(cli, ["verify", str(files / "good.kvz"), "-q", "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.output)["files"][0]
    assert row["tiers_decoded"] == ["coarse", "exact"] and row["bytes_checked"] > 0


@pytest.mark.parametrize("args", [["verify"], ["verify", "--no-decode"], ["inspect", "--verify"]])
def test_a_flipped_payload_byte_fails(files, args):
    res = CliRunner().invoke(cli, [*args, str(files / "bad.kvz")] + (["-q"] if args[0] == "verify" else []))
    assert res.exit_code != 0
    assert "checksum mismatch" in res.output and len(res.output.strip().splitlines()) == 1


def test_plain_inspect_reads_only_the_index(files):
    assert CliRunner().invoke(cli, ["inspect", str(files / "bad.kvz")]).exit_code == 0


def test_save_cache_takes_the_cache_load_cache_returns(tmp_path):
    c = synthetic_cache(n_layers=1, T=20, d=8)
    for args in ((tmp_path / "a.safetensors", c), (c, tmp_path / "b.safetensors")):
        save_cache(*args)
    for name in ("a", "b"):
        back = load_cache(tmp_path / f"{name}.safetensors")
        assert np.array_equal(back.tensors["layers.0.key"], c.tensors["layers.0.key"])
    with pytest.raises(KvzError, match="tensors must be a Cache"):
        save_cache(tmp_path / "c.safetensors", [1, 2])


def test_a_bank_of_another_shape_says_so_before_any_rope_question():
    rng = np.random.default_rng(0)
    kv = [(rng.standard_normal((2, 80, 64)).astype(np.float16),) * 2 for _ in range(4)]
    with pytest.raises(BankMismatchError, match="bank fits"):
        compress_bytes(Cache.from_arrays(kv), budget=0.05, bank="gemma-3-270m")


def test_tiny_eps_names_the_smallest_usable_value():
    c = synthetic_cache(n_layers=1, T=40, d=8)
    with pytest.raises(EncodeError, match=r"use eps >= \d"):
        compress_bytes(c, budget=1e-9, bank=fit_bank([c], rank=None))


def test_bad_eps_is_refused_before_the_input_is_read(tmp_path):
    res = CliRunner().invoke(cli, ["compress", str(tmp_path / "missing.safetensors"), "--eps", "0"])
    assert res.exit_code != 0 and "eps must be a number in (0, 1)" in res.output
    assert not os.path.exists(tmp_path / "missing.kvz")
