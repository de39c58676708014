"""On paper: a prefix hit's load time on a serving node, raw bf16 against kvz, from measured decode
throughput per core. Nothing here is timed; every input is a measurement named by its source.

For a prefix of ``T`` tokens of a model with ``L`` layers, ``H`` KV heads of ``d`` values, the hit
moves ``V = 2·L·H·d·T`` values. Raw: ``V·2`` bytes over the link (``raw_s``). kvz: ``V·bpv/8``
bytes over the link (``read_s``) and ``V / (cores × per-core throughput)`` of decode (``decode_s``),
overlapped layer by layer as the vLLM connector does (``kvz_s = max(read, decode) + min(read,
decode)/L``). ``needed`` is the per-core decode throughput at which kvz's load equals raw's. The
rest of the prefill (the tokens after the prefix) is the same for both and left out; with a
layer-wise load the forward hides part of either load, so these are the loads' upper bounds.
Decode is assumed to scale with cores (it did from 1 to 2 cores here: ``speed.md``); memory
bandwidth bounds that on a real node, which is not modelled.

    python -m kvz.benchmarks.hit_model [--speed benchmarks/results/speed.json] [--hit benchmarks/results/vllm_hit.json]
        [--cores 32] --json OUT --md OUT

>>> r = hit_row(values=1e9, bpv=4.0, per_core=50e6, cores=32, link_Bps=3.125e9, layers=32)
>>> round(r["raw_s"], 3), round(r["read_s"], 3), round(r["decode_s"], 3), round(r["kvz_s"], 3)
(0.64, 0.16, 0.625, 0.63)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

#: (name, layers, kv_heads, head_dim): Gemma 3 270M (kvz's test model) and Llama 3.1 8B (its config.json)
MODELS = [("Gemma 3 270M", 18, 1, 256), ("Llama 3.1 8B", 32, 8, 128)]
#: bytes/s of the links of an H100 serving node: local NVMe (PCIe 4 x4), 25 and 100 GbE
LINKS = [("NVMe 7 GB/s", 7e9), ("25 GbE", 25e9 / 8), ("100 GbE", 100e9 / 8)]


def hit_row(values: float, bpv: float, per_core: float, cores: int, link_Bps: float, layers: int) -> dict:
    """Load times (s) of one hit of ``values`` values: raw bf16 and kvz at ``bpv`` decoding at
    ``per_core`` values/s on each of ``cores`` cores, over a link of ``link_Bps`` bytes/s."""
    raw = values * 2 / link_Bps
    read = values * bpv / 8 / link_Bps
    dec = values / (per_core * cores)
    kvz = max(read, dec) + min(read, dec) / layers
    # kvz == raw where decode dominates: dec + read/L = raw -> per_core = V / (cores (raw - read/L))
    slack = raw - read / layers
    needed = values / (cores * slack) if slack > 0 else float("inf")
    return {"raw_s": raw, "read_s": read, "decode_s": dec, "kvz_s": kvz, "x_raw": kvz / raw,
            "needed_per_core": needed if read < raw else float("inf")}


def sources(speed_json: str | None, hit_json: str | None) -> list[dict]:
    """Per-core decode throughputs: the in-process speed benchmark (1 thread, ``aggregate`` rows) and
    the vLLM hit benchmark's in-engine decode (values decoded / decode seconds)."""
    out = []
    if speed_json and Path(speed_json).exists():
        d = json.loads(Path(speed_json).read_text())
        cpu = d.get("machine", {}).get("cpu", "?")
        for r in d.get("aggregate", []):
            if r["op"] == "decode" and r["threads"] == 1 and r["codec"].startswith("kvz"):
                out.append({"source": f"speed.json ({cpu}, {d.get('created', '')[:10]}), {r['codec']}, in process",
                            "bpv": r["bpv"], "per_core": r["vps"]})
    if hit_json and Path(hit_json).exists():
        got = json.loads(Path(hit_json).read_text())
        d = got[-1] if isinstance(got, list) else got  # vllm_reuse --hit --json: one result per size
        for r in d.get("rows", []):
            if r.get("link") == "local" and r.get("decode_s") and r["store"].startswith("kvz") and r["store"] != "kvz-auto":
                v = 2 * 18 * 1 * 256 * r["cached_tokens"]
                out.append({"source": f"vllm_hit ({d.get('cpu', '?')}), {r['store']}, in vLLM, 1 load core",
                            "bpv": 8 * r["bytes_per_token"] / (2 * 18 * 256), "per_core": v / r["decode_s"]})
    return out


def table(srcs: list[dict], cores: int = 32, tokens: int = 8192) -> list[dict]:
    rows = []
    for name, L, H, d in MODELS:
        values = 2 * L * H * d * tokens
        for link, bw in LINKS:
            for s in srcs:
                rows.append({"model": name, "tokens": tokens, "link": link, "cores": cores, **s,
                             **hit_row(values, s["bpv"], s["per_core"], cores, bw, L)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [f"# A prefix hit on paper: {rows[0]['tokens']} tokens, {rows[0]['cores']} decode cores", "",
             "Load only (the rest of the prefill is the same for raw and kvz). `needed`: per-core decode "
             "throughput at which kvz's load equals raw's. Inputs: measured throughputs (source column); "
             "decode assumed to scale with cores.", "",
             "| model | link | throughput source | bpv | per core Mv/s | raw s | kvz read s | kvz decode s | kvz s "
             "| × raw | needed Mv/s per core |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        need = f"{r['needed_per_core'] / 1e6:.0f}" if r["needed_per_core"] != float("inf") else "—"
        lines.append(f"| {r['model']} | {r['link']} | {r['source']} | {r['bpv']:.2f} | {r['per_core'] / 1e6:.1f} "
                     f"| {r['raw_s']:.3f} | {r['read_s']:.3f} | {r['decode_s']:.3f} | {r['kvz_s']:.3f} "
                     f"| {r['x_raw']:.2f} | {need} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", default="benchmarks/results/speed.json")
    ap.add_argument("--hit", default="benchmarks/results/vllm_hit.json")
    ap.add_argument("--cores", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    srcs = sources(a.speed, a.hit)
    if not srcs:
        ap.error("no throughput measurements found (give --speed and/or --hit)")
    rows = table(srcs, a.cores, a.tokens)
    md = markdown(rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"inputs": srcs, "rows": rows, "cores": a.cores}, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
