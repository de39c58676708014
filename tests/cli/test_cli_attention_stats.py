"""capture -> calibrate -> the bank's attention statistics (issue 20, point 1): captures made with
attention statistics give `kvz calibrate` a `<bank>.attention.json`; captures without give none and
no alarm; a mixture uses those that have them and names the others; `kvz bank show` / `list` say
whether a bank has them. Fast tests on a tiny random Gemma 3 (token ids, no tokenizer); the real
Gemma 3 270M through `kvz capture --attention-stats`, and the fit against the bundled sidecar, in slow tests."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from alignpred.bank import AttentionStats, CaptureStats, capture_stats_path  # noqa: E402
from kvz.cli.main import cli  # noqa: E402


def _tiny_gemma(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=32,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                         "full_attention": dict(rope_type="default", rope_theta=1e6)})
    return transformers.Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return _tiny_gemma()


def _ids(n, seed):
    return [1] + np.random.default_rng(seed).integers(3, 256, n - 1).tolist()


@pytest.fixture(scope="module")
def captures(tiny, tmp_path_factory):
    """Three 48-token captures with statistics, one without."""
    from kvz.integrations.hf.capture import capture_model

    d = tmp_path_factory.mktemp("caps")
    out = []
    for i in range(4):
        p = d / f"c{i}.safetensors"
        s = capture_model(tiny, None, _ids(48, i), p, dtype="float32", model_id="tiny-gemma", source=f"c{i}",
                          attention_stats=capture_stats_path(p) if i < 3 else None)
        assert (s["attention_stats"] is not None) == (i < 3)
        out.append(p)
    return out


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_capture_record_matches_the_prefill(tiny, captures):
    from kvz.integrations.hf.querystats import record_query_stats

    rec = CaptureStats.load(capture_stats_path(captures[0]))
    st = record_query_stats(tiny, _ids(48, 0))
    assert rec.model == "tiny-gemma" and rec.n_tokens == 48 and rec.shape == (2, 2, 32)
    assert np.allclose(rec.q_channel, st.q_channel, rtol=1e-5) and np.allclose(rec.mass, st.mass, atol=1e-7)
    assert np.allclose(rec.mass.sum(-1), 1.0, atol=1e-5)
    assert not capture_stats_path(captures[3]).exists()


def test_calibrate_writes_the_sidecar_from_captures_with_stats(captures, tmp_path):
    out = tmp_path / "b.h5"
    r = _run("calibrate", *captures[:3], "-o", out, "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    side = tmp_path / "b.attention.json"
    assert res["attention_stats"] == {"path": str(side), "captures": 3, "tokens": 144, "without": []}
    s = AttentionStats.find(out)
    assert s is not None and s.bank_id == res["bank_id"] and s.key_channel.shape == (2, 2, 32)
    recs = [CaptureStats.load(capture_stats_path(c)) for c in captures[:3]]
    assert np.allclose(s.key_channel, np.mean([x.q_channel for x in recs], axis=0), rtol=1e-5)
    assert s.meta["sources"] == ["c0.safetensors", "c1.safetensors", "c2.safetensors"]
    show = _run("bank", "show", out)
    assert show.exit_code == 0 and show.output.splitlines()[-1] == \
        "attention statistics: 2 layers x 2 KV heads (beside the bank)", show.output


def test_calibrate_without_stats_writes_none_and_says_nothing(captures, tmp_path):
    out = tmp_path / "plain.h5"
    r = _run("calibrate", captures[3], "-o", out)
    assert r.exit_code == 0, r.output
    assert len(r.output.strip().splitlines()) == 1 and "attention" not in r.output
    assert not (tmp_path / "plain.attention.json").exists()
    show = _run("bank", "show", out)
    assert "attention statistics: none (kvz calibrate on captures made with kvz capture --attention-stats)" \
        in show.output


def test_calibrate_mixed_uses_those_with_stats_and_names_the_rest(captures, tmp_path):
    out = tmp_path / "mixed.h5"
    r = _run("calibrate", captures[0], captures[3], "-o", out)
    assert r.exit_code == 0, r.output
    assert "attention statistics of 1 of 2 captures (48 tokens)" in r.output
    assert "without statistics (not used for them): c3.safetensors" in r.output
    assert AttentionStats.find(out).meta["sources"] == ["c0.safetensors"]
    # replaced (--force) by a bank of captures without statistics: the old sidecar goes with it
    r = _run("calibrate", captures[3], "-o", out, "--force")
    assert r.exit_code == 0 and "removed" in r.output and not (tmp_path / "mixed.attention.json").exists()


def test_bad_statistics_are_one_line_before_the_fit(captures, tmp_path):
    import shutil

    c = tmp_path / "c.safetensors"
    shutil.copy(captures[0], c)
    capture_stats_path(c).write_text("{not json")
    r = _run("calibrate", c, "-o", tmp_path / "b.h5")
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "c.capture-stats.json" in r.output
    assert not (tmp_path / "b.h5").exists()
    shutil.copy(capture_stats_path(captures[1]), capture_stats_path(c))  # another prefill's statistics
    r = _run("calibrate", c, "-o", tmp_path / "b.h5")
    assert r.exit_code != 0 and "another prefill" in r.output
    stray = tmp_path / "s.attention.json"  # a bank sidecar beside no bank is not replaced without --force
    stray.write_text("{}")
    r = _run("calibrate", captures[0], "-o", tmp_path / "s.h5")
    assert r.exit_code != 0 and "s.attention.json exists" in r.output


def test_bank_list_says_which_banks_have_stats(captures, tmp_path, monkeypatch):
    d = tmp_path / "banks"
    d.mkdir()
    assert _run("calibrate", captures[0], "-o", d / "with.h5").exit_code == 0
    assert _run("calibrate", captures[3], "-o", d / "without.h5").exit_code == 0
    monkeypatch.setenv("KVZ_BANK_PATH", str(d))
    r = _run("bank", "list", "--json")
    rows = {b["name"]: b["attention_stats"] for b in json.loads(r.output)["banks"]}
    assert rows["with"] is True and rows["without"] is False and rows["gemma-3-270m"] is True
    r = _run("bank", "list")
    assert r.output.splitlines()[-1] == "with attention statistics: with, gemma-3-270m"


def test_capture_refuses_to_replace_stats_without_force(tmp_path):
    out = tmp_path / "x.safetensors"
    capture_stats_path(out).write_text("{}")
    r = _run("capture", "some text", "-o", out, "--attention-stats", "-q")
    assert r.exit_code != 0 and "x.capture-stats.json exists; pass --force" in r.output


@pytest.mark.model
def test_real_gemma_capture_calibrate_roundtrip(gemma, tmp_path):
    """`kvz capture --attention-stats` on the real Gemma 3 270M, then `kvz calibrate` on it."""
    from pathlib import Path

    text = Path(__file__).resolve().parents[2] / "samples" / "texts" / "english-prose.txt"
    out = tmp_path / "g.safetensors"
    r = _run("capture", text, "--file", "--tokens", "64", "-o", out, "--attention-stats", "-q")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1].startswith(str(capture_stats_path(out)))
    rec = CaptureStats.load(capture_stats_path(out))
    assert rec.model == "gemma-3-270m" and rec.shape == (18, 1, 256) and rec.n_tokens == 64
    assert (rec.mass[:, 0, 0] > 5.0 / 64).all()  # the sink
    r = _run("calibrate", out, "-o", tmp_path / "g.h5", "--json")
    assert r.exit_code == 0, r.output
    s = AttentionStats.find(tmp_path / "g.h5")
    assert s.key_channel.shape == (18, 1, 256) and s.value_frame.shape == (18, 1, 256)
    bundled = AttentionStats.find("gemma-3-270m")  # same model: the same W_o Gram
    assert np.allclose(s.value_gram_eig, bundled.value_gram_eig, rtol=1e-3, atol=1e-3 * bundled.value_gram_eig.max())


@pytest.mark.model
def test_calibrate_fit_reproduces_the_bundled_sidecar(gemma):
    """kvz calibrate's fit (fit_attention_stats) on the bundled bank's calibration prefills gives the
    bundled sidecar (written by benchmarks/studies/rate/attention_gain.py --fit) to float32 rounding."""
    from pathlib import Path

    from alignpred.bank import fit_attention_stats, resolve_bank
    from kvz.benchmarks.rate_quality import documents
    from kvz.integrations.hf.capture import tokenize
    from kvz.integrations.hf.querystats import capture_stats, record_query_stats

    m, tok = gemma
    recs = []
    for _, path in documents("calib"):
        ids = tokenize(tok, Path(path).read_text(encoding="utf-8"))[:2048]
        recs.append(capture_stats(m, record_query_stats(m, ids), ids, model_id="gemma-3-270m"))
    s = fit_attention_stats(recs, resolve_bank("gemma-3-270m"))
    ref = AttentionStats.find("gemma-3-270m")
    for n in ("key_channel", "value_gram_eig", "value_gram_diag", "key_frame", "value_frame", "token_prior",
              "token_quantiles", "token_prior_sq", "token_quantiles_sq"):
        a, b = getattr(s, n).astype(np.float64), getattr(ref, n).astype(np.float64)
        assert a.shape == b.shape and np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), n
