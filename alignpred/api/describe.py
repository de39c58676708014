"""What a :class:`~alignpred.api.reader.KvzReader` says about its file: the summary ``kvz
inspect`` prints, and the source metadata of a decoded subset."""
from __future__ import annotations

import json
import math

from alignpred.codec.budget import STEP_UNIT
from alignpred.codec.scopes import scope_of
from alignpred.format.container import ENTRY_SIZE


def slice_metadata(reader, start: int, sel: list) -> dict:
    """The source metadata, adjusted for a decoded subset: per-layer lists cut to the layers
    kept, and the RoPE position offset moved to the first token kept."""
    meta = reader.source_metadata
    lay = reader.layout
    keep = list(sel)
    for key in ("layer_types", "rope_theta"):
        if key in meta:
            try:
                v = json.loads(meta[key])
                meta[key] = json.dumps([v[i] for i in keep]) if isinstance(v, list) else meta[key]
            except (ValueError, TypeError, IndexError):
                del meta[key]
    if lay.rope is not None:
        spec = lay.rope
        meta["rope"] = json.dumps({"tables": [t.to_json() for t in spec.tables],
                                   "layer_table": [spec.layer_table[i] for i in keep]})
    if start or "position_offset" in meta:
        meta["position_offset"] = str(lay.position_offset + start)
    return meta


def summarize(reader) -> dict:
    """:meth:`KvzReader.summary <alignpred.api.reader.KvzReader.summary>`."""
    lay = reader.layout
    size = len(reader._buf)
    per = {}
    for ti, m in enumerate(reader.metas):
        ents = reader.index[ti * reader.n_objects_per_tensor:(ti + 1) * reader.n_objects_per_tensor]
        nbytes = sum(e.length for e in ents) + ENTRY_SIZE * len(ents)
        n_vals = lay.kv_heads * lay.n_tokens * lay.head_dim
        steps = {} if m.step_codes is None else {"step_multiplier_min": int(m.step_codes.min()) / STEP_UNIT,
                                                  "step_multiplier_max": int(m.step_codes.max()) / STEP_UNIT}
        if m.plain_sq_err is not None:  # attention scope: plain NRMSE over the positions a later query reads
            steps["plain_nrmse_read"] = math.sqrt(m.plain_sq_err / m.plain_sq_norm) if m.plain_sq_norm else 0.0
        per[m.name] = {**steps, "nrmse": math.sqrt(m.sq_err / m.sq_norm) if m.sq_norm > 0 else 0.0,
                       "bpv_payload": 8.0 * nbytes / n_vals,
                       "max_object_nrmse": max((math.sqrt(e.sq_err / e.sq_norm) if e.sq_norm > 0 else 0.0)
                                               for e in ents)}
    tot_e = sum(m.sq_err for m in reader.metas)
    tot_n = sum(m.sq_norm for m in reader.metas)
    emb, codec = reader.header["bank"].get("embedded"), reader.header["codec"]
    tier_bytes = {}
    n_c = len(reader.metas) * reader.n_objects_per_tensor
    for k, name in enumerate(reader.tiers):
        tier_bytes[name] = sum(e.length + ENTRY_SIZE for e in reader.index[k * n_c:(k + 1) * n_c])
    return {"file": reader.path, "version": ".".join(map(str, reader.version)), "layout": lay.to_json(),
            "eps": reader.eps, "eps_scope": reader.scope, "tensor_cap": reader.tensor_cap, "tiers": list(reader.tiers),
            "tier_payload_bytes": tier_bytes, "coder": codec["entropy"]["coder"],
            "config": reader.config.to_json(), "bank_id": reader.bank_id, "bank_embedded": bool(emb),
            "bank_bytes": int(emb["length"]) if emb else 0,
            "file_bytes": size, "n_values": lay.n_values, "bpv": 8.0 * size / lay.n_values,
            "nrmse_pooled": math.sqrt(tot_e / tot_n) if tot_n > 0 else 0.0,
            "nrmse_max_tensor": max(v["nrmse"] for v in per.values()), "tensors": per, "error_measure":
            scope_of(reader.scope).measure, "plain_cap": float(codec.get("plain_cap", 0.0))}
