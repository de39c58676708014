"""The bank registry: calibration banks found by content id or name, wherever kvz is installed.

A file records the sha256 content id of its bank; a reader needs the bank itself. Banks are
looked up, in this order, in

1. the folders of ``$KVZ_BANK_PATH`` (``os.pathsep``-separated),
2. the user's bank folder: ``$KVZ_BANK_DIR``, else ``$XDG_DATA_HOME/kvz/banks``
   (``~/.local/share/kvz/banks``) — where ``kvz bank add`` puts banks,
3. the banks shipped with kvz (package data: ``alignpred/bank/data/``, e.g. ``gemma-3-270m``).

A *bank reference* is a path to a bank file, its content id (``sha256:<hex>``, or a unique
prefix of at least 8 hex digits) or its registry name (the file name without ``.h5``).

>>> [e.name for e in registry() if e.name == "gemma-3-270m"]
['gemma-3-270m']
>>> find("gemma-3-270m").model
'gemma-3-270m'
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from alignpred.errors import BankMismatchError, KvzError

PACKAGE_DIR = Path(__file__).resolve().parent / "data"
_ID = re.compile(r"^(sha256:)?([0-9a-f]{8,64})$")


def user_dir() -> Path:
    """Where ``kvz bank add`` puts banks."""
    env = os.environ.get("KVZ_BANK_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvz" / "banks"


def search_dirs() -> list[tuple[str, Path]]:
    """``(origin, folder)`` in lookup order."""
    dirs = [("KVZ_BANK_PATH", Path(d).expanduser()) for d in os.environ.get("KVZ_BANK_PATH", "").split(os.pathsep) if d]
    dirs.append(("user", user_dir()))
    dirs.append(("bundled", PACKAGE_DIR))
    return dirs


@dataclass(frozen=True)
class BankEntry:
    """A bank in the registry (read from its attributes only: cheap)."""

    name: str
    id: str
    model: str
    signature: dict
    config: dict
    path: str
    origin: str

    def fits(self, layout) -> bool:
        return self.signature == layout.signature()

    def load(self):
        from alignpred.bank.bank import Bank

        return Bank.load(self.path)

    @property
    def attention_stats_path(self) -> Path:
        """Where this bank's attention statistics live (``<name>.attention.json`` beside it)."""
        from alignpred.bank.attention_stats import sidecar_path

        return sidecar_path(self.path)

    @property
    def has_attention_stats(self) -> bool:
        """Whether a sidecar of attention statistics lies beside the bank (not read: cheap; see
        :meth:`attention_stats` for a checked load)."""
        return self.attention_stats_path.is_file()

    def attention_stats(self):
        """The bank's :class:`~alignpred.bank.AttentionStats` (the model-aware error measure of
        issue 20), or None if it has none. A malformed sidecar, or one of another bank, is an
        :class:`~alignpred.bank.AttentionStatsError`.

        >>> find_entry = lookup("gemma-3-270m")
        >>> find_entry.attention_stats().bank_id == find_entry.id
        True
        """
        from alignpred.bank.attention_stats import stats_beside

        return stats_beside(self.path, self.id)


_CACHE: dict = {}


def _entry(path: Path, origin: str) -> BankEntry | None:
    from alignpred.io import read_bank_attrs

    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key in _CACHE:
            return _CACHE[key]
        man, cid = read_bank_attrs(path)
        m = json.loads(man)
        e = BankEntry(path.stem, cid, str(m.get("model", "")), dict(m.get("signature", {})), dict(m.get("config", {})),
                      str(path), origin)
    except (OSError, KvzError, ValueError, TypeError, AttributeError):
        return None
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = e
    return e


def registry() -> list[BankEntry]:
    """Every bank in the search folders, in lookup order (a folder that does not exist is skipped)."""
    out = []
    for origin, d in search_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.h5")):
            e = _entry(p, origin)
            if e is not None:
                out.append(e)
    return out


def lookup(ref: str) -> BankEntry | None:
    """The registry entry for an id, id prefix or name (first in lookup order), or None."""
    ref = str(ref)
    m = _ID.match(ref.lower())
    entries = registry()
    if m:
        hexid = m.group(2)
        hits = [e for e in entries if e.id.startswith("sha256:" + hexid)]
        if len({e.id for e in hits}) > 1:
            raise BankMismatchError(f"bank id prefix {ref!r} is ambiguous; give more digits")
        if hits:
            return hits[0]
    for e in entries:
        if e.name == ref:
            return e
    return None


def find(ref, layout=None):
    """A :class:`~alignpred.bank.bank.Bank` from a reference (a ``Bank`` is returned as is; a path is
    loaded; an id or a name is looked up in the registry). Raises :class:`BankMismatchError`
    with what is known — and the registered banks that fit ``layout``, if given."""
    from alignpred.bank.bank import Bank

    if isinstance(ref, Bank):
        return ref
    ref_s = os.fspath(ref)
    if os.path.sep in ref_s or ref_s.endswith(".h5") or os.path.exists(ref_s):
        bank = Bank.load(ref_s)
        _LOADED_FROM.setdefault(bank.id, set()).add(os.path.abspath(ref_s))
        return bank
    e = lookup(ref_s)
    if e is None:
        raise BankMismatchError(f"no bank file or registered bank {ref_s!r}{_fitting_hint(layout)}")
    return e.load()


def resolve_bank(ref, layout=None, *, session=None):
    """The one bank resolver: every caller that turns a *bank reference* into a
    :class:`~alignpred.bank.bank.Bank` goes through here (the CLI, :func:`~alignpred.compress`,
    :class:`~alignpred.KvzReader`, :class:`~alignpred.DecoderSession`).

    ``ref``: a ``Bank`` (returned as is), a path to a bank file, a content id (or unique prefix of
    at least 8 hex digits) or a registry name. ``None`` is an error that names the registered banks
    fitting ``layout``. ``session``: a :class:`BankRegistry` asked first for ids (banks already
    loaded), which keeps what it loads.

    >>> resolve_bank("gemma-3-270m").id == resolve_bank(resolve_bank("gemma-3-270m").id).id
    True
    """
    if ref is None:
        if layout is None:
            raise BankMismatchError("a calibration bank is needed (bank=...)" + _fitting_hint(None))
        es = fitting(layout)
        hint = (f"; the {es[0].origin} bank {es[0].name!r} fits this cache: pass bank={es[0].name!r}" if es else
                "; fit one with alignpred.fit_bank on other caches of this model, or pass a self-calibrated bank "
                "(fit_bank([cache]) with profile=Profile(embed_bank=True))")
        raise BankMismatchError(f"compression needs a calibration bank (bank=...){hint}")
    if session is not None and isinstance(ref, (str, os.PathLike)):
        hit = session.get(os.fspath(ref))
        if hit is None:
            hit = _session_hit(session, os.fspath(ref))
        if hit is not None:
            return hit
    bank = find(ref, layout)
    if session is not None:
        session.add(bank)
    return bank


def _session_hit(session, ref: str):
    """The bank a path or registry name refers to, if ``session`` holds it already: the file's id
    comes from its registry entry (cached by path, mtime and size), so a reader given a bank by
    name or path does not load and hash the bank file again (~24 ms for the bundled bank)."""
    if os.path.sep in ref or ref.endswith(".h5") or os.path.exists(ref):
        e = _entry(Path(ref), "path") if os.path.isfile(ref) else None
    else:
        try:
            e = lookup(ref)
        except BankMismatchError:
            return None
    return session.get(e.id) if e is not None else None


class BankRegistry:
    """Banks already loaded, by content id, in front of the on-disk registry (what a
    :class:`~alignpred.DecoderSession` holds so that many small files load their bank once).

    >>> reg = BankRegistry()
    >>> b = reg.for_file(resolve_bank("gemma-3-270m").id, layout=None)
    >>> reg.get(b.id) is b
    True
    """

    def __init__(self, banks=()):
        self._banks = {b.id: b for b in banks}

    def add(self, bank) -> None:
        self._banks[bank.id] = bank

    def get(self, bank_id: str):
        """A loaded bank by exact id, or None."""
        return self._banks.get(bank_id)

    def for_file(self, bank_id: str, layout, where: str = ""):
        """The bank a file names (by content id): loaded, or from the registry, or a
        :class:`BankMismatchError` that names registered banks of the same shape."""
        b = self._banks.get(bank_id)
        if b is None:
            e = lookup(bank_id)
            if e is None:
                raise missing_bank_error(bank_id, layout, where)
            b = self._banks[bank_id] = e.load()
        return b


def fitting(layout) -> list[BankEntry]:
    """Registered banks whose signature fits ``layout`` (same model name first)."""
    es = [e for e in registry() if e.fits(layout)]
    es.sort(key=lambda e: (e.model != layout.model, e.origin != "bundled"))
    return es


def _fitting_hint(layout) -> str:
    if layout is None:
        return " (`kvz bank list` shows the registered ones)"
    es = fitting(layout)
    if not es:
        return (f"; no registered bank fits this cache ({layout.signature()}): fit one on other caches of the "
                "model (alignpred.fit_bank, `kvz calibrate`) and register it (`kvz bank add`)")
    e = es[0]
    what = "bundled " if e.origin == "bundled" else "registered "
    return f"; the {what}bank {e.name!r} ({e.model or 'unknown model'}, {e.id[:19]}…) fits this cache"


def missing_bank_error(bank_id: str, layout, where: str = "") -> BankMismatchError:
    """The error for a file whose bank is not in the registry (naming a registered bank of the
    same shape, which may be the right one under another id)."""
    dirs = ", ".join(str(d) for _, d in search_dirs())
    es = fitting(layout) if layout is not None else []
    other = (f" (registered banks of this shape: {', '.join(repr(e.name) for e in es[:3])} — a file decodes only "
             "with its own bank)") if es else ""
    return BankMismatchError(f"{where}needs bank {bank_id[:19]}…, which is not in the registry ({dirs}){other}; "
                             "pass the bank it was written with, or register it with `kvz bank add`")


def add(path, name: str | None = None, force: bool = False) -> BankEntry:
    """Copy a bank file into the user folder (verified first: it must load and match its id). Its
    attention statistics (``<stem>.attention.json`` beside it, checked) go with it."""
    from alignpred.bank.attention_stats import stats_beside
    from alignpred.bank.bank import Bank
    from alignpred.errors import OutputExistsError
    from alignpred.io import ensure_dir

    bank = Bank.load(path)
    stats = stats_beside(path, bank.id)  # a malformed or stale sidecar is reported before anything is copied
    name = name or (f"{bank.model}-{bank.id[7:15]}" if bank.model else bank.id[7:23])
    if not re.match(r"^[A-Za-z0-9._-]{1,100}$", name):
        raise KvzError(f"bank name {name!r}: use letters, digits, '.', '_' and '-'")
    dst = Path(ensure_dir(user_dir())) / f"{name}.h5"
    if dst.exists() and not force:
        from alignpred.io import read_bank_attrs

        same = _entry(dst, "user") if read_bank_attrs(dst)[1] == bank.id else None
        if same is not None:
            if stats is not None and not same.has_attention_stats:
                stats.save(same.attention_stats_path)
            return same
        raise OutputExistsError(f"{dst} exists and holds another bank; choose another --name or pass --force")
    bank.save(dst)
    e = _entry(dst, "user")
    if e is None:
        raise KvzError(f"{dst}: the bank written there does not read back")
    if stats is not None:
        stats.save(e.attention_stats_path)
    elif e.has_attention_stats:  # left by the bank this one replaced: stale unless it is of this bank
        from alignpred.bank.attention_stats import AttentionStatsError

        try:
            e.attention_stats()
        except AttentionStatsError:
            e.attention_stats_path.unlink()
    return e


# bank id -> the files this process loaded it from by path (their ``<stem>.sensitivity.json`` is
# looked at first: a bank fitted by ``kvz calibrate --model`` and given by path, not registered)
_LOADED_FROM: dict[str, set[str]] = {}


def loaded_from(bank_id: str) -> list[str]:
    """The bank files (absolute paths) this process loaded the bank ``bank_id`` from by path."""
    return sorted(_LOADED_FROM.get(bank_id, ()))


def sensitivity(bank_id: str, model: str = "") -> dict | None:
    """The downstream-sensitivity record of a bank (``<stem>.sensitivity.json`` beside a bank file
    loaded by path, or beside a registered bank; matched by ``bank_id``; written by ``kvz calibrate
    --model`` and ``benchmarks/studies/rate/sensitivity.py``): per-tensor weights in KL per NRMSE², used by the
    weighted scope and ``target_kl``. None if there is none."""
    from alignpred.io import read_json

    candidates = [p for f in loaded_from(bank_id)
                  if (p := Path(f).with_suffix(".sensitivity.json")).is_file()]
    for _, d in search_dirs():
        if d.is_dir():
            candidates += sorted(d.glob("*.sensitivity.json"))
    for p in candidates:
        rec = read_json(p)
        if isinstance(rec, dict) and rec.get("bank_id") == bank_id and isinstance(rec.get("tensor_weights"), dict):
            return rec
    return None
