"""Decoder set-up shared across files (:class:`DecoderSession`): banks by id, prediction plans per
(bank, codec configuration, layout shape), and optional per-stage timings of every decode."""
from __future__ import annotations

import json
from collections import OrderedDict

from alignpred.bank.bank import Bank
from alignpred.bank.registry import BankRegistry
from alignpred.codec.config import CodecConfig
from alignpred.codec.decoder import Decoder
from alignpred.format.header import check_bank

__all__ = ["DecoderSession", "DEFAULT_SESSION"]


class DecoderSession:
    """Decoder set-up shared across files: banks by id, and prediction plans per (bank, codec
    configuration, layout shape). A loader that decodes many small files (chunks of a chunk
    store) passes one session to every :class:`KvzReader` and pays the set-up once; readers
    without one share a module-wide session.

    ``banks``: banks to use by id before the registry is asked (e.g. one loaded once).
    """

    def __init__(self, banks=(), max_plans: int = 8, timer=None):
        self.banks = BankRegistry(banks)
        self.timer = timer  # a StageTimer: per-stage decode timings of every reader of this session
        self._plans: OrderedDict = OrderedDict()
        self.max_plans = max_plans
        self.plans_built = 0

    def bank(self, bank_id: str, layout, where: str = "") -> Bank:
        return self.banks.for_file(bank_id, layout, where)

    def add_bank(self, bank: Bank) -> None:
        self.banks.add(bank)

    def decoder(self, layout, bank: Bank, config: CodecConfig, coder: str) -> Decoder:
        """A decoder with plans from the cache (built and the bank checked on first use)."""
        key = (bank.id, json.dumps(config.to_json(), sort_keys=True), tuple(sorted(layout.signature().items())))
        plans = self._plans.get(key)
        if plans is None:
            check_bank(bank, layout, config)
            dec = Decoder(layout, bank, config, coder)
            dec.timer = self.timer
            self.plans_built += 1
            self._plans[key] = dec.plans
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
            return dec
        self._plans.move_to_end(key)
        dec = Decoder(layout, bank, config, coder, plans=plans)
        dec.timer = self.timer
        return dec


DEFAULT_SESSION = DecoderSession()
