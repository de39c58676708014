"""Checks of a file's object index against its layout (format_spec/kvz.md §7), before any payload
is read: one entry per (tier, tensor, object) in layout order, valid flags, steps and error
statistics, payloads contiguous from the preamble to the header (or the embedded bank)."""
from __future__ import annotations

from alignpred.codec.chain import OBJ_REFINE, OBJ_ZERO
from alignpred.errors import FormatError
from alignpred.format.container import PREAMBLE_SIZE
from alignpred.format.header import _f32, _nonneg

__all__ = ["check_index"]


def check_index(index, lay, S: int, n_tensors: int, n_tiers: int, bank: dict, header_offset: int) -> int:
    """Raise :class:`FormatError` unless ``index`` is exactly what the layout and tiers need;
    returns the number of objects per tensor."""
    n_obj = -(-lay.n_tokens // S)
    n_coarse = n_obj * n_tensors
    if len(index) != n_coarse * n_tiers:
        raise FormatError(f"index holds {len(index)} objects, layout and tiers need "
                          f"{n_coarse * n_tiers}")
    prev_end = PREAMBLE_SIZE
    for k, ent in enumerate(index):
        tier, kk = divmod(k, n_coarse)
        ti, j = divmod(kk, n_obj)
        want_n = min(S, lay.n_tokens - j * S)
        if ent.tensor != ti or ent.token_start != j * S or ent.n_tokens != want_n:
            raise FormatError(f"index entry {k} does not follow the layout order")
        want_flag = OBJ_REFINE if tier else 0
        if (ent.flags & ~OBJ_ZERO) != want_flag or bool(ent.flags & OBJ_ZERO) != (ent.length == 0):
            raise FormatError(f"index entry {k} has invalid flags")
        if tier:
            if ent.delta != 0.0 or ent.sq_err != 0.0:
                raise FormatError(f"refinement entry {k} has a step or an error")
        elif not _f32(ent.delta) or (not (ent.flags & OBJ_ZERO) and not ent.delta > 0):
            raise FormatError(f"index entry {k} has an invalid quantisation step")
        if not (_nonneg(ent.sq_err) and _nonneg(ent.sq_norm)):
            raise FormatError(f"index entry {k} has invalid error statistics")
        if ent.offset != prev_end:
            raise FormatError(f"index entry {k}: payloads must be contiguous")
        prev_end = ent.offset + ent.length
    emb = bank.get("embedded")
    end = prev_end + (int(emb["length"]) if emb else 0)
    if emb and int(emb["offset"]) != prev_end:
        raise FormatError("embedded bank offset is inconsistent")
    if end != header_offset:
        raise FormatError("payloads do not end where the header starts")
    return n_obj
