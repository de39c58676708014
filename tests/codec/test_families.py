"""Capture from transformers decoder families × RoPE variants, with exact RoPE metadata.

Tiny random-weight models are built from each family's config class (no download): 3 layers,
4 query heads, 2 KV heads, head_dim 16..256, Gemma 2/3 with sliding and full layers. Trained
models have a large mean key direction; random weights do not, so every model gets a shared
component in its token embeddings (``E = 0.25 · noise + m``): it flows through the norms into
``k_proj`` as a big per-layer mean key, which RoPE rotates position by position — the
structure that makes undoing RoPE pay on real caches.

Exactness: the pre-RoPE keys are taken from the model itself (forward hooks on ``k_norm`` /
``k_proj`` / Phi-3's fused ``qkv_proj``), independently of the rotation code, and the recorded
keys with RoPE undone by the recorded spec must equal them to float32 rounding.
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from alignpred.cache.rope import RopeSpec, RopeTable  # noqa: E402
from kvz.integrations.hf.capture import capture_model, load_model, write_cache_atomic  # noqa: E402
from kvz.integrations.hf.rope import (  # noqa: E402
    UnsupportedRope,
    decoder_of,
    prefill_chunk,
    rope_spec_from_config,
    rope_spec_from_model,
)

COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
SF = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {  # config class, extra config, head_dim
    "llama": ("LlamaConfig", dict(head_dim=64), 64),
    "qwen2": ("Qwen2Config", dict(), 16),  # k_proj has a bias
    "qwen3": ("Qwen3Config", dict(head_dim=128), 128),  # k_norm
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=48), 32),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5), 16),  # fused qkv, rotary_dim 8
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=48, layer_types=SF), 32),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=256, sliding_window=48, layer_types=SF), 256),  # k_norm
}
T = 160  # > max_position_embeddings (128) and > the original 64 of yarn/llama3/longrope
CHUNK = 64


def _variant(name: str, rotary_half: int) -> dict | None:
    ramp = [1.0 + 0.05 * i for i in range(rotary_half)]
    return {
        "default": None,
        "linear": dict(rope_type="linear", factor=2.0),
        "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64),
        "dynamic": dict(rope_type="dynamic", factor=2.0),
        "yarn": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64),
        "longrope": dict(rope_type="longrope", short_factor=[1.0] * rotary_half, factor=2.0,
                         long_factor=[2.0 * f for f in ramp], original_max_position_embeddings=64),
    }[name]


def make_config(family: str, variant: str = "default", **over):
    cls_name, extra, d = FAMILIES[family]
    kw = {**COMMON, **extra, **over}
    if kw.get("head_dim", d) is None:
        del kw["head_dim"]
    d = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    theta = 1e4
    rp = _variant(variant, int(d * kw.get("partial_rotary_factor", 1.0)) // 2)
    if family == "phi3":
        kw["original_max_position_embeddings"] = 64  # Phi-3 keeps it at the top level
    if family == "gemma3":  # per layer type; the variant goes to the full-attention layers (as Gemma 3 4B+)
        full = dict(rope_type="default", rope_theta=1e6) if rp is None else {**rp, "rope_theta": 1e6}
        kw["rope_parameters"] = {"sliding_attention": dict(rope_type="default", rope_theta=theta),
                                 "full_attention": full}
    elif rp is not None:
        kw["rope_parameters"] = {**rp, "rope_theta": theta}
        if family == "phi3" and "partial_rotary_factor" in kw:
            kw["rope_parameters"]["partial_rotary_factor"] = kw["partial_rotary_factor"]
    return getattr(transformers, cls_name)(**kw)


def make_model(family: str, variant: str = "default", seed: int = 0, **over):
    """A tiny random model with a shared embedding component (a realistic mean key)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, variant, **over)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        E = model.get_input_embeddings().weight
        E.copy_(0.25 * torch.randn(E.shape, generator=g) + torch.randn(E.shape[1], generator=g))
    return model


class PreRope:
    """Records every layer's keys before RoPE from the model's own projections."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.kvh, self.heads = cfg.num_key_value_heads, cfg.num_attention_heads
        self.rec: dict = {}
        self.hooks = []

    def __enter__(self):
        for i, layer in enumerate(decoder_of(self.model).layers):
            attn = layer.self_attn
            d = attn.head_dim
            if hasattr(attn, "k_norm"):
                mod, kind = attn.k_norm, "norm"
            elif hasattr(attn, "k_proj"):
                mod, kind = attn.k_proj, "proj"
            else:
                mod, kind = attn.qkv_proj, "qkv"
            self.rec[i] = []
            self.hooks.append(mod.register_forward_hook(
                lambda m, a, out, i=i, kind=kind, d=d: self._keep(i, kind, d, out)))
        return self.rec

    def _keep(self, i, kind, d, out):
        o = out.detach().float()
        if kind == "qkv":
            q = self.heads * d
            o = o[..., q:q + self.kvh * d]
        if o.dim() == 3:  # [B, t, kvh*d]
            o = o.reshape(o.shape[0], o.shape[1], self.kvh, d)
        if o.shape[2] == self.kvh and o.shape[1] != self.kvh:  # [B, t, kvh, d] -> [B, kvh, t, d]
            o = o.transpose(1, 2)
        self.rec[i].append(o[0].clone())

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def _read(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def _undo_error(spec: RopeSpec, tensors: dict, pre: dict) -> list[float]:
    """Per layer: max |RoPE⁻¹(recorded key) - pre-RoPE key| / max |pre-RoPE key|."""
    errs = []
    for i in range(spec.num_layers):
        k = tensors[f"layers.{i}.key"].numpy()
        want = torch.cat(pre[i], dim=-2).numpy()
        t = spec.table(i)
        got = k if t is None else t.apply(k, 0, inverse=True)
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
    return errs


MATRIX = ([("llama", v) for v in ("default", "linear", "llama3", "dynamic", "yarn", "longrope")]
          + [("qwen2", "default"), ("qwen2", "yarn"), ("qwen3", "default"), ("qwen3", "dynamic"),
             ("mistral", "default"), ("mistral", "linear"), ("phi3", "default"), ("phi3", "longrope"),
             ("gemma2", "default"), ("gemma2", "linear"), ("gemma3", "default"), ("gemma3", "linear"),
             ("gemma3", "yarn")])
LENGTH_DEPENDENT = ("dynamic", "longrope")
UNDO_ERRORS: dict = {}


# a few variants in the default run, the whole matrix in CI's slow pass
FAST = {("llama", "default"), ("llama", "dynamic"), ("gemma3", "default")}


@pytest.mark.parametrize("family,variant", [pytest.param(f, v, marks=() if (f, v) in FAST else pytest.mark.slow, id=f"{f}-{v}")
                                            for f, v in MATRIX])
def test_capture_rope_exact(family, variant, tmp_path):
    model = make_model(family, variant)
    ids = np.random.default_rng(7).integers(3, 256, T).tolist()
    out = tmp_path / "c.safetensors"
    with PreRope(model) as pre:
        s = capture_model(model, None, ids, out, dtype="float32", chunk=CHUNK, model_id=f"tiny-{family}",
                          source="unit")
    meta, tensors = _read(out)
    d = FAMILIES[family][2]
    assert (s["tokens"], s["layers"], s["kv_heads"], s["head_dim"]) == (T, 3, 2, d)
    assert sorted(tensors) == sorted(f"layers.{i}.{k}" for i in range(3) for k in ("key", "value"))
    assert all(v.shape == (2, T, d) and v.dtype == torch.float32 for v in tensors.values())
    assert (meta["format"], meta["keys_roped"], meta["position_offset"], meta["model"], meta["source"]) == (
        "kvz-cache", "true", "0", f"tiny-{family}", "unit")
    assert json.loads(meta["token_ids"]) == ids
    assert json.loads(meta["layer_types"]) == list(getattr(model.config, "layer_types", None) or ["full_attention"] * 3)
    # the spec: metadata JSON round trip, from the model and from the config alone
    spec = RopeSpec.from_json(json.loads(meta["rope"]))
    assert spec == s["rope"] == rope_spec_from_model(model, T) == rope_spec_from_config(model.config, T)
    assert RopeSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    # one prefill call when chunks would get other frequencies (dynamic NTK / longrope beyond their length)
    assert s["chunk"] == (T if variant in LENGTH_DEPENDENT else CHUNK)
    # exactness: RoPE undone with the recorded spec gives the model's pre-RoPE keys
    errs = _undo_error(spec, tensors, pre)
    UNDO_ERRORS[(family, variant)] = max(errs)
    assert max(errs) < 2e-6, errs
    # ... and the check is sensitive: no undo, or a default table in place of a scaled one, is far off
    assert min(float(np.abs(tensors[f"layers.{i}.key"].numpy() - torch.cat(pre[i], -2).numpy()).max()
                     / torch.cat(pre[i], -2).abs().max()) for i in range(3)) > 1e-2
    tables = {t for t in spec.tables}
    rot = {t.rotary_dim for t in tables}
    assert rot == {d // 2 if family == "phi3" else d}
    if variant in ("yarn", "longrope"):
        assert any(t.attention_scaling != 1.0 for t in tables)
    if variant != "default":
        plain = RopeSpec(tuple(RopeTable.from_theta(1e6 if family == "gemma3" and i == 1 else 1e4, d,
                                                    rotary_dim=spec.table(i).rotary_dim) for i in range(3)), (0, 1, 2))
        assert max(_undo_error(plain, tensors, pre)) > 1e-3


def test_undo_error_summary():
    """Prints the max undo error per family/variant (run with -s); all far below float32 noise."""
    if UNDO_ERRORS:
        print("\nmax relative RoPE-undo error:", {f"{f}-{v}": f"{e:.2e}" for (f, v), e in sorted(UNDO_ERRORS.items())})
        assert max(UNDO_ERRORS.values()) < 2e-6


def test_gemma3_layer_types_get_their_tables():
    model = make_model("gemma3", "linear", head_dim=32)
    spec = rope_spec_from_model(model, 100)
    assert spec.layer_table == (0, 1, 0) and len(spec.tables) == 2
    slide, full = spec.tables
    assert slide == RopeTable(model.model.rotary_emb.sliding_attention_inv_freq.tolist())
    assert full.inv_freq == tuple(model.model.rotary_emb.full_attention_inv_freq.tolist())
    assert full.inv_freq[0] == np.float32(1 / 2.0)  # linear factor 2 on the full layers only


@pytest.mark.parametrize("variant,short,long_", [("dynamic", 128, 129), ("longrope", 64, 65)])
def test_length_dependent_tables(variant, short, long_):
    """Dynamic NTK / longrope: the table depends on the prefilled length, and chunked prefill
    is used only while it does not change."""
    family = "phi3" if variant == "longrope" else "llama"
    model = make_model(family, variant)
    a, b = rope_spec_from_model(model, short), rope_spec_from_model(model, long_)
    assert a != b and a == rope_spec_from_model(model, 10)
    assert prefill_chunk(model, short, 32) == 32 and prefill_chunk(model, long_, 32) == long_
    # first chunk already beyond the limit: longrope chunks agree (long factors); dynamic NTK grows per chunk
    assert prefill_chunk(model, 2 * long_, long_) == (long_ if variant == "longrope" else 2 * long_)
    # the model's own state after a long sequence does not leak into a later capture
    with torch.no_grad():
        model.model(input_ids=torch.randint(3, 200, (1, 300)))
    assert rope_spec_from_model(model, short) == a


def test_chunked_dynamic_capture_short_text(tmp_path):
    model = make_model("llama", "dynamic")
    ids = list(range(3, 103))  # 100 <= max_position_embeddings: frequencies fixed, chunks allowed
    s = capture_model(model, None, ids, tmp_path / "d.safetensors", dtype="float32", chunk=32)
    assert s["chunk"] == 32 and s["rope"].tables[0] == RopeTable(tuple(model.model.rotary_emb.original_inv_freq.tolist()))


def test_rope_changing_between_chunks_is_refused(monkeypatch, tmp_path):
    import kvz.integrations.hf.capture as cap

    model = make_model("llama", "dynamic")
    monkeypatch.setattr("kvz.integrations.hf.rope.prefill_chunk", lambda m, n, c: c)  # force chunks
    with pytest.raises(RuntimeError, match="RoPE parameters changed"):
        cap.capture_model(model, None, list(range(3, 203)), tmp_path / "x.safetensors", chunk=64)
    assert not (tmp_path / "x.safetensors").exists()


def test_unsupported_rotation_is_refused(monkeypatch):
    """A rotation that is not RoPE-with-pairing (here: keys negated) raises instead of a wrong spec."""
    import transformers.models.llama.modeling_llama as ml

    model = make_model("llama")
    orig = ml.apply_rotary_pos_emb

    def negated(q, k, cos, sin, unsqueeze_dim=1):
        return tuple(-t for t in orig(q, k, cos, sin, unsqueeze_dim))

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", negated)
    with pytest.raises(UnsupportedRope, match="not a RoPE kvz can express"):
        rope_spec_from_model(model, 50)


def test_interleaved_pairing_detected(monkeypatch):
    """A model rotating pairs (2i, 2i+1) gets pairing='interleaved' (probe of its rotation)."""
    import transformers.models.llama.modeling_llama as ml

    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    def apply_interleaved(q, k, cos, sin, unsqueeze_dim=1):
        h = cos.shape[-1] // 2
        cos = cos[..., :h].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
        sin = sin[..., :h].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
        return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", apply_interleaved)
    model = make_model("llama")
    spec = rope_spec_from_model(model, 80)
    assert spec.tables[0].pairing == "interleaved"


def test_bfloat16_model_refused():
    model = make_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        rope_spec_from_model(model, 10)


# -- loading, CLI ---------------------------------------------------------------------------------------
def _save_with_tokenizer(model, directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a of and to in is was it for on with as by at from cache key value token model".split()
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                                  pad_token="[PAD]")
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return tok


def test_load_model_directory_and_cli(tmp_path):
    from click.testing import CliRunner

    from kvz.cli.capture_cmd import capture

    model = make_model("qwen3", head_dim=32)
    _save_with_tokenizer(model, tmp_path / "m")
    m2, tok = load_model(tmp_path / "m")
    assert tok is not None and next(m2.parameters()).dtype == torch.float32 and not m2.training
    text = " ".join(["the key of the model is a value in the cache"] * 12)
    res = CliRunner().invoke(capture, [text, "--model", str(tmp_path / "m"), "-o", str(tmp_path / "c.safetensors"),
                                       "--chunk", "32", "-q", "--tokens", "100"])
    assert res.exit_code == 0, res.output
    meta, tensors = _read(tmp_path / "c.safetensors")
    ids = json.loads(meta["token_ids"])
    assert len(ids) == 100 and ids[0] == 1 and meta["model"] == "m"
    assert RopeSpec.from_json(json.loads(meta["rope"])) == rope_spec_from_model(m2, 100)
    assert json.loads(meta["rope_theta"]) == [1e4] * 3  # plain default RoPE: legacy field too
    with torch.inference_mode():  # the recorded keys are the model's own cache
        ref = m2.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    for i in range(3):
        assert torch.allclose(tensors[f"layers.{i}.key"].float(), ref.layers[i].keys[0].to(torch.bfloat16).float())
    bad = CliRunner().invoke(capture, ["some text", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "no such file" in bad.output and "Traceback" not in bad.output


def _write_tiny_llama_gguf(model, path):
    """A float32 GGUF of a tiny Llama (llama.cpp tensor names, q/k rows permuted as its converter does)."""
    gguf = pytest.importorskip("gguf")
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("llama")
    toks = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(cfg.vocab_size - 3)]
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types([2, 3, 3] + [1] * (len(toks) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def permute(t, n_head):
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        for g, h in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[p + h + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_load_model_gguf(tmp_path):
    """load_model reads a GGUF file (dequantized to float32 by transformers); the capture is exact."""
    model = make_model("llama", vocab_size=64, tie_word_embeddings=False, head_dim=None)
    _write_tiny_llama_gguf(model, tmp_path / "tiny.gguf")
    m2, tok = load_model(tmp_path / "tiny.gguf")
    assert type(m2).__name__ == "LlamaForCausalLM" and tok is not None and not m2.training
    ref = model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in m2.state_dict().items())
    ids = list(range(1, 64)) * 2
    with PreRope(m2) as pre:
        s = capture_model(m2, tok, ids, tmp_path / "g.safetensors", dtype="float32", chunk=50)
    meta, tensors = _read(tmp_path / "g.safetensors")
    assert s["rope"] == rope_spec_from_model(model, len(ids)) and json.loads(meta["token_ids"]) == ids
    assert max(_undo_error(s["rope"], tensors, pre)) < 2e-6


def test_metadata_rope_theta_only_for_default_rope(tmp_path):
    s = capture_model(make_model("llama", "yarn"), None, list(range(3, 40)), tmp_path / "y.safetensors")
    meta, _ = _read(tmp_path / "y.safetensors")
    assert "rope_theta" not in meta and "rope" in meta and s["dtype"] == "bfloat16"


# -- compression with the library (needs the layout's RoPE spec integration) ------------------------------
COMPRESS = [("llama", "yarn", {}), ("qwen2", "default", {}), ("gemma3", "linear", dict(head_dim=64)),
            ("phi3", "longrope", {})]


@pytest.mark.parametrize("family,variant,over", [pytest.param(f, v, o, marks=() if f == "qwen2" else pytest.mark.slow, id=f"{f}-{v}")
                                                  for f, v, o in COMPRESS])
def test_compress_roundtrip_and_rope_pays(family, variant, over, tmp_path):
    from alignpred import KvzReader, compress, fit_bank, load_cache

    model = make_model(family, variant, **over)
    rng = np.random.default_rng(3)
    paths = []
    for j in range(2):  # calibration cache and test cache: same model, other tokens
        p = tmp_path / f"c{j}.safetensors"
        capture_model(model, None, rng.integers(3, 256, 300).tolist(), p, chunk=128)
        paths.append(p)
    sizes = {}
    for mode in ("rope", "plain"):
        if mode == "plain":  # the same caches, RoPE metadata removed: keys coded as they are
            for j, p in enumerate(paths):
                meta, t = _read(p)
                for k in ("keys_roped", "rope", "rope_theta", "rope_pairing"):
                    meta.pop(k, None)
                paths[j] = write_cache_atomic(t, meta, tmp_path / f"plain{j}.safetensors")
        cal, test = (load_cache(str(p)) for p in paths)
        assert test.layout.keys_roped == (mode == "rope")
        bank = fit_bank([cal], rank=None)
        out = tmp_path / f"{mode}.kvz"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "looks RoPE-rotated but keys_roped=false" in plain mode
            info = compress(test, str(out), budget=0.05, bank=bank)
        dec = KvzReader(str(out), bank=bank).read()
        for name in test.layout.tensor_names():
            x = np.asarray(test.tensors[name], np.float32)
            y = np.asarray(dec[name], np.float32)
            nrmse = float(np.sqrt(np.mean((x - y) ** 2) / np.mean(x ** 2)))
            assert nrmse <= 0.05 * (1 + 1e-6), (mode, name, nrmse)
        sizes[mode] = info.file_bytes
    assert sizes["rope"] < sizes["plain"], sizes
