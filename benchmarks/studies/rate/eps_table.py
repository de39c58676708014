"""Choosing eps: what each error budget costs in bits and changes in what the model says next.

For the bundled Gemma 3 270M on held-out prompts (windows of ``samples/texts``, BOS first; the bank was
fitted on other documents) each eps is run through :func:`kvz.benchmarks.quality.run_quality`: the
prompt's K/V (bfloat16, as stored) is compressed with the bundled bank, decoded, injected into a fresh
model cache, and the model continues ``--new-tokens`` tokens. Rows: bits per value (file bytes), mean
next-token KL against the model's own float32 cache along the reference continuation, the share of
prompts whose greedy continuation is identical over all ``--new-tokens`` tokens, and the mean position of
the first differing token. A ``--lossless`` file and the bfloat16 cast (what every stored row starts
from) are the floors; FP8 e4m3 (per-tensor scale) is for scale.

Run::

    python -m benchmarks.studies.rate.eps_table --prompts 12 --new-tokens 32

writes ``benchmarks/results/eps_table.json`` and ``eps_table.md`` (``--out DIR`` elsewhere).
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvz.benchmarks.harness import RESULTS, command_line, machine_info, parser, resolve_bank, write_json, write_text

__all__ = ["EPS", "settings", "format_rows", "main"]

EPS = (0.005, 0.01, 0.02, 0.0267, 0.04, 0.06)


def settings(bank, eps_list=EPS) -> dict:
    """``{row name: Setting}``: the bf16 floor, kvz lossless, kvz at each eps (tensor scope), FP8 e4m3."""
    from kvz.benchmarks.quality import fp8_setting, identity_setting, kvz_setting

    s = {"bf16 (the stored cache)": identity_setting("bf16"),
         "kvz --lossless": kvz_setting(bank, 0.0267, lossless=True)}
    for e in eps_list:
        s[f"kvz --eps {e:g}"] = kvz_setting(bank, e)
    s["fp8 e4m3"] = fp8_setting()
    return s


def format_rows(res: dict) -> str:
    """The Markdown table of ``res`` (the results JSON)."""
    n_new = res["config"]["new_tokens"]
    n = res["config"].get("n_prompts_done", res["config"]["n_prompts"])
    lines = [f"| setting | bits/value | mean next-token KL | identical greedy continuations (of {n} x {n_new} "
             f"tokens) | mean first differing token (/{n_new}) |", "|---|---:|---:|---:|---:|"]
    for name, s in res["settings"].items():
        if "kl_mean" not in s:
            continue
        lines.append(f"| {name} | {s['bpv']:.2f} | {s['kl_mean']:.2e} | {100 * s['identical_frac']:.0f}% | "
                     f"{s['first_div_mean']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m benchmarks.studies.rate.eps_table", quiet=True)
    ap.add_argument("--eps", default=",".join(f"{e:g}" for e in EPS), help="comma-separated eps values")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256, help="prompt length in tokens (BOS included)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS), help="output directory (eps_table.json, eps_table.md)")
    a = ap.parse_args(argv)
    a.command = command_line("studies.rate.eps_table", argv)
    res = run(a)
    print(format_rows(res))
    return 0


def markdown(res: dict) -> str:
    return ("# Choosing eps (Gemma 3 270M, bundled bank)\n\n" + format_rows(res)
            + f"\n\nCommand: `{res['config']['command']}`.\n")


def run(a) -> dict:
    """The quality run of every setting; writes ``eps_table.{json,md}`` under ``a.out`` (and a partial
    pair after each prompt, removed at the end)."""
    from kvz.benchmarks.quality import run_quality

    eps = [float(x) for x in a.eps.split(",") if x.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"bank": "gemma-3-270m (bundled)", "scope": "tensor", "sources": "eval",
             "command": a.command, "machine": machine_info()}

    def save(res, stem):
        res["config"].update(extra)
        write_json(res, out / f"{stem}.json")
        write_text(out / f"{stem}.md", markdown(res))

    res = run_quality(settings(resolve_bank(), eps), n_prompts=a.prompts, prompt_tokens=a.tokens,
                      new_tokens=a.new_tokens, progress=not a.quiet, sources="eval",
                      on_prompt=lambda r: save(r, "eps_table.partial"))
    save(res, "eps_table")
    for f in ("eps_table.partial.json", "eps_table.partial.md"):
        (out / f).unlink(missing_ok=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
