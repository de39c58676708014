"""Speed profiles (``compress(profile=)``, ``kvz compress --profile``): each meets the same error
budget, records its coder and predictors in the header, and decodes to the same bits on any
thread count."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from kvz_testing import sample_paths

from alignpred import CodecConfig, ErrorBudget, KvzError, KvzReader, compress, load_cache
from alignpred.codec import PROFILES, profile


def _nrmse(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


@pytest.fixture(scope="module")
def sample():
    return load_cache(sample_paths()[0])


@pytest.fixture(scope="module")
def files(sample, real_bank):
    return {p: compress(sample, None, budget=ErrorBudget(eps=0.03, scope="tensor"), bank=real_bank, profile=p) for p in PROFILES}


def test_every_profile_meets_the_budget_and_records_its_choices(sample, real_bank, files):
    for name, info in files.items():
        r = KvzReader(info.data, bank=real_bank)
        s = r.summary()
        assert s["coder"] == PROFILES[name].coder
        assert s["config"]["inter_map"] is PROFILES[name].inter_map
        out = r.read()
        for k, x in sample.tensors.items():
            assert _nrmse(x, out[k]) <= 0.03 * (1 + 1e-6), (name, k)


def test_profiles_trade_bits_for_speed_in_order(files):
    """The fast profile drops the linear maps, so it needs more bits; balanced only changes the
    entropy coder (12-bit tables and per-lane states), so it is within a few percent of default."""
    bpv = {k: v.bpv for k, v in files.items()}
    assert bpv["default"] < bpv["balanced"] < bpv["fast"]
    assert bpv["balanced"] - bpv["default"] < 0.1
    assert bpv["fast"] - bpv["default"] > 0.3


@pytest.mark.parametrize("name", ["balanced", "fast"])
def test_a_profile_decodes_to_the_same_bits_on_any_thread_count(files, real_bank, name):
    ref = KvzReader(files[name].data, bank=real_bank, threads=1).read()
    for th in (2, 3):
        out = KvzReader(files[name].data, bank=real_bank, threads=th).read()
        assert all(np.array_equal(ref[k].view(np.uint16), out[k].view(np.uint16)) for k in ref)


def test_default_profile_is_the_plain_call(sample, real_bank, files):
    plain = compress(sample, None, budget=ErrorBudget(eps=0.03, scope="tensor"), bank=real_bank)
    assert plain.data == files["default"].data


def test_a_profile_keeps_the_rest_of_the_config(sample, real_bank):
    cfg = CodecConfig(sink_tokens=4)
    info = compress(sample, None, budget=ErrorBudget(eps=0.05, scope="tensor"), bank=real_bank, profile="fast", config=cfg)
    s = KvzReader(info.data, bank=real_bank).summary()
    assert s["config"]["sink_tokens"] == 4 and s["config"]["inter_map"] is False


def test_profile_errors(sample, real_bank):
    with pytest.raises(KvzError, match="unknown profile 'tiny'"):
        compress(sample, None, budget=0.05, bank=real_bank, profile="tiny")
    with pytest.raises(KvzError, match=r"no longer takes eps=, coder=: write budget=0\.05, profile=profile\('fast', coder='rans4'\)"):
        compress(sample, None, eps=0.05, bank=real_bank, profile="fast", coder="rans4")
    with pytest.raises(KvzError, match="unknown entropy coder 'rans9'"):
        compress(sample, None, budget=0.05, bank=real_bank, profile=profile("fast", coder="rans9"))
    with pytest.raises(KvzError, match="unknown profile"):
        profile(None)


def test_cli_profile(tmp_path):
    from kvz.cli.main import PROFILE_NAMES, cli

    assert PROFILE_NAMES == list(PROFILES)
    out = tmp_path / "f.kvz"
    r = CliRunner().invoke(cli, ["compress", sample_paths()[0], "--bank", "gemma-3-270m", "--profile", "fast",
                                 "-o", str(out), "-q", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["profile"] == "fast"
    r = CliRunner().invoke(cli, ["inspect", str(out)])
    assert r.exit_code == 0 and "entropy coder lanes32, linear maps off" in r.output
    r = CliRunner().invoke(cli, ["compress", sample_paths()[0], "--bank", "gemma-3-270m", "--profile", "tiny",
                                 "-o", str(tmp_path / "g.kvz")])
    assert r.exit_code != 0 and "tiny" in r.output and not (tmp_path / "g.kvz").exists()
