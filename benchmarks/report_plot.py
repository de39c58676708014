"""The rate-distortion figure of ``kvz bench`` (``rd.png``): measured error against bits per value for
every coder, one panel per allocation (:mod:`kvz.benchmarks.report` writes it with the report)."""
from __future__ import annotations

from .harness import pyplot, save_figure
from .report import ERR_NAME, LOSSLESS, _err, _main_rows, _plain


def plot(res: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6), sharey=False)
    methods = [m for m in res["methods"] if m not in LOSSLESS]
    cmap = plt.get_cmap("tab20")
    colors = {m: ("black" if m == "kvz" else cmap(i % 20)) for i, m in enumerate(methods)}
    markers = {"fp8_e4m3": "s", "fp8_e5m2": "D", "kivi_int8": "^", "kivi_int4": "v", "kivi_int2": "<"}
    for ax, alloc in zip(axes, ("tensor", "pooled")):
        for m in methods:
            rs = [r for r in _main_rows(res, m, alloc) if _err(r) > 0]
            sweep = sorted((r for r in rs if r["eps_target"] is not None and r["extra"].get("meets_target")
                            is not False), key=lambda r: r["bpv"])
            nat = [r for r in rs if r["eps_target"] is None]
            lab = _plain(m)
            if len(sweep) >= 2:
                ax.plot([r["bpv"] for r in sweep], [_err(r) for r in sweep], "-o", color=colors[m], label=lab,
                        lw=2.6 if m == "kvz" else 1.3, ms=4 if m != "kvz" else 5, zorder=5 if m == "kvz" else 3)
                lab = None
            elif sweep:
                ax.plot([r["bpv"] for r in sweep], [_err(r) for r in sweep], "o", color=colors[m], label=lab, ms=7,
                        mfc="none", mew=1.8)
                lab = None
            if nat:
                ax.plot([r["bpv"] for r in nat], [_err(r) for r in nat], markers.get(m, "P"), color=colors[m],
                        label=lab, ms=8)
        e8 = res["eps_fp8"][alloc]
        ax.axhline(e8, ls="--", color="grey", lw=1)
        ax.text(ax.get_xlim()[0] if False else 0.99, e8, " FP8 e4m3 error", transform=ax.get_yaxis_transform(),
                ha="right", va="bottom", fontsize=8, color="grey")
        ax.set_xscale("log")
        ax.set_yscale("log")
        from matplotlib.ticker import FuncFormatter
        fmt = FuncFormatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_major_formatter(fmt)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if round(v) == v and v in (2, 3, 4, 5, 6, 8, 12, 16)
                                                   else ""))
        ax.yaxis.set_major_formatter(fmt)
        ax.set_xlabel("bits per value (bpv)")
        ax.set_ylabel(f"measured {ERR_NAME[alloc]}")
        ax.set_title(f"{alloc} allocation ({ERR_NAME[alloc]} <= eps)")
        ax.grid(True, which="both", alpha=0.25)
    h, lab = [], []
    for ax in axes:
        for hh, ll in zip(*ax.get_legend_handles_labels()):
            if ll not in lab:
                h.append(hh)
                lab.append(ll)
    fig.legend(h, lab, loc="lower center", ncol=min(len(lab), 7), fontsize=8, frameon=False)
    n = len(res["caches"])
    fig.suptitle(f"kvz bench: rate-distortion on {n} cache(s), {res['caches'][0]['model']} "
                 f"({res['caches'][0]['n_tokens']} tokens each)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    save_figure(fig, path, dpi=90)
