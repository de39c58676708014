"""The speed benchmark's plot: decode and encode speed per codec, and the break-even link speeds."""
from __future__ import annotations

import math

import numpy as np

from ..harness import pyplot, save_figure
from .acceptance import agg_row


def write_plot(res: dict, path: str) -> None:
    """Decode and encode values/s per codec and thread count, and the break-even link speeds."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = res.get("aggregate", [])
    n_all = res["machine"]["all_threads"]
    ths = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for ax, ops, title in ((axes[0], ("decode", "decode_into"), "decode"), (axes[1], ("encode",), "encode")):
        labels = []
        for r in rows:
            if r["op"] in ops:
                lab = r["codec"] + (" read_into" if r["op"] == "decode_into" else "")
                if lab not in labels:
                    labels.append(lab)
        y = np.arange(len(labels))
        h = 0.8 / max(len(ths), 1)
        for i, th in enumerate(ths):
            vals = []
            for lab in labels:
                codec, op = (lab.split(" ")[0], "decode_into") if lab.endswith("read_into") else (lab, ops[0])
                r = agg_row(rows, codec, op, th)
                vals.append(r["vps"] / 1e6 if r else np.nan)
            ax.barh(y + i * h, vals, h, label=f"{th} thread{'s' if th > 1 else ''}")
            for yy, v in zip(y + i * h, vals):
                if np.isfinite(v):
                    ax.text(v, yy, f" {v:.0f}", va="center", fontsize=7)
        ax.set_yticks(y + h * (len(ths) - 1) / 2)
        ax.set_yticklabels(labels)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("million values / s (wall, median)")
        ax.set_title(f"{title} ({res['n_caches']} caches x {res.get('tokens', '?')} tokens)")
        ax.legend(fontsize=8)
        ax.invert_yaxis()
    ax = axes[2]
    bes = [(r["codec"] + (" read_into" if r["op"] == "decode_into" else ""), r["break_even_Bps"], r["bpv"])
           for r in rows if r["op"].startswith("decode") and r["threads"] == n_all]
    bes = [(lab, b * 8 / 1e9, bpv) for lab, b, bpv in bes if b is not None and math.isfinite(b)]
    if bes:
        y = np.arange(len(bes))
        ax.barh(y, [b for _, b, _ in bes], color="tab:green")
        ax.set_yticks(y)
        ax.set_yticklabels([f"{lab} ({bpv:.2f} bpv)" for lab, _, bpv in bes])
        for yy, (_, b, _) in zip(y, bes):
            ax.text(b, yy, f" {b:.2f}", va="center", fontsize=7)
        ax.invert_yaxis()
    ax.set_xlabel("Gbit/s (load + decode beats raw bf16 below this)")
    ax.set_title(f"break-even link speed ({n_all} threads)")
    m = res["machine"]
    fig.suptitle(f"kvz speed - {m.get('cpu', '?')}, {m.get('usable_cores', '?')} cores, load avg "
                 f"{res.get('loadavg_start')} -> {res.get('loadavg_end')}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
