"""Scheduling model of draft/verify serving (VeriCache, long-context decoding on one GPU): the
seed's throughput model (Eq. 3) and an iteration-level simulation of ``B`` concurrent requests
with bandwidth-ring and HBM-ring admission, staggered versus lock-step verification, fed with
measured acceptance (``benchmarks/studies/serving/verify.py``).

The machine: ``M`` bytes of weights in HBM of ``hbm_bytes`` at ``bw_hbm`` bytes/s, and a serial
host->GPU link (PCIe) at ``bw_link`` bytes/s. A request holds its compressed cache
(``c * kv_full`` bytes) in HBM; its full K/V lives in host memory and crosses the link before
each verify, occupying HBM from the start of its transfer to the end of its verify.

One *iteration* runs every request's next step: drafting requests decode one token each against
their compressed caches, verifying requests run one forward over their drafts against the full
K/V. Its GPU time is HBM-bound: ``(M + sum_drafting c*KV + sum_verifying KV) / bw_hbm``. An
iteration cannot start before the transfers of its verifiers are done (the wait is a *stall*).

Policies:

* ``staggered`` - the paper's Admit (Algorithm 1): after each verify, request ``r`` picks its next
  verify iteration ``d`` nearest the target draft length ``x`` (fanning out ``x, x+-1, ...``) for
  which the link (BW ring: link seconds per iteration <= ``T_iter``) and HBM (HBM ring:
  ``M + resident + transient <= hbm``) can take its ``S_r`` windows of transfer; the transfer
  starts ``S_r`` iterations before ``d``. Not admitted: it waits an iteration and retries.
* ``lockstep`` - every request drafts ``x`` tokens and all verify in the same iteration; their
  transfers are issued ``S_r`` iterations before it (as each would be staggered), so the link
  serialises ``B`` transfers into one window.
* ``lockstep_prefetch`` - lock-step, but transfers are issued as early as HBM allows. If the
  ``B`` full caches cannot all be in HBM at once, the common verify is done in groups that fit.

Acceptance: :class:`AcceptModel` resamples measured rounds (drafts, accepted); a round whose run
of matches reached its draft length is continued geometrically with the measured per-token
acceptance, so draft lengths other than the measured one can be served.

>>> hw = Hardware("rtx-pro-6000", hbm_bytes=96e9, bw_hbm=1.6e12, bw_link=64e9, model_bytes=48e9)
>>> g, x_ = eq3_iter_time(hw, B=6, kv_full=5e9, c=0.2, x=25)   # the seed's worked example
>>> f"{g * 1e3:.1f} ms HBM, {x_ * 1e3:.1f} ms link"
'34.5 ms HBM, 18.8 ms link'
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Hardware", "AcceptModel", "eq3_iter_time", "full_kv_baseline", "simulate", "SCENARIOS"]


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float
    bw_hbm: float
    bw_link: float
    model_bytes: float


SCENARIOS = {
    # The seed's worked example: Mistral-24B (fp16 weights) on an RTX PRO 6000, PCIe 5 x16, 50K context.
    "rtx6000-24b-50k": (Hardware("RTX PRO 6000 / 24B", 96e9, 1.6e12, 64e9, 48e9), 5e9),
    # An 8B model (GQA 8 KV heads) on an H100 SXM at 100K context (~13 GB of fp16 K/V per request).
    "h100-8b-100k": (Hardware("H100 80GB / 8B", 80e9, 3.35e12, 64e9, 16e9), 13e9),
}


class AcceptModel:
    """Emitted tokens per verify, resampled from measured ``rounds = [(drafted, accepted), ...]``."""

    def __init__(self, rounds):
        rounds = [(int(d), int(k)) for d, k in rounds if int(d) > 0]
        if not rounds:
            raise ValueError("no measured rounds with drafts")
        self.rounds = rounds
        acc = sum(k for _, k in rounds)
        rej = sum(1 for d, k in rounds if k < d)
        # per-token acceptance, geometric with censoring; one pseudo-rejection keeps it below 1 when
        # no measured round was ever rejected
        self.p_continue = acc / (acc + max(rej, 1))

    def run_length(self, rng) -> int:
        d, k = self.rounds[int(rng.integers(len(self.rounds)))]
        if k < d or self.p_continue <= 0:
            return k
        return k + int(rng.geometric(1.0 - self.p_continue)) - 1  # further matches after the measured run

    def emitted(self, d: int, rng) -> int:
        """Tokens emitted by a verify of ``d`` drafts: the accepted prefix plus the correction/bonus."""
        return min(self.run_length(rng), int(d)) + 1

    def mean_emitted(self, d: int, n: int = 20000, seed: int = 0) -> float:
        rng = np.random.default_rng(seed)
        return float(np.mean([self.emitted(d, rng) for _ in range(n)]))


def eq3_iter_time(hw: Hardware, B: int, kv_full: float, c: float, x: int) -> tuple[float, float]:
    """The seed's Eq. (3): ``(T_gpu, T_xfer)``; the staggered iteration time is their max."""
    t_gpu = (hw.model_bytes + B * kv_full * (c + 1.0 / x)) / hw.bw_hbm
    t_xfer = B * kv_full / (x * hw.bw_link)
    return t_gpu, t_xfer


def full_kv_baseline(hw: Hardware, B: int, kv_full: float) -> dict:
    """Plain decoding with every request's full K/V resident: as many as fit run each iteration."""
    fit = int(max(0, (hw.hbm_bytes - hw.model_bytes) // kv_full))
    b = min(B, fit)
    if b == 0:
        return {"policy": "full_kv", "B_running": 0, "tokens_per_s": 0.0, "iter_ms": math.inf,
                "hbm_peak_gb": hw.model_bytes / 1e9}
    t = (hw.model_bytes + b * kv_full) / hw.bw_hbm
    return {"policy": "full_kv", "B_running": b, "tokens_per_s": b / t, "iter_ms": t * 1e3,
            "hbm_peak_gb": (hw.model_bytes + b * kv_full) / 1e9}


class _Ring:
    """Per-iteration reservations (absolute iteration index -> amount)."""

    def __init__(self):
        self.v: dict = {}

    def get(self, i):
        return self.v.get(i, 0.0)

    def add(self, i, a):
        self.v[i] = self.v.get(i, 0.0) + a

    def trim(self, before):
        for i in [i for i in self.v if i < before]:
            del self.v[i]


def simulate(hw: Hardware, *, B: int, kv_full: float, c: float, x: int, accept: AcceptModel,
             policy: str = "staggered", iterations: int = 3000, window: int = 128, seed: int = 0,
             max_draft: int | None = None) -> dict:
    """Run ``iterations`` iterations of ``B`` always-busy requests; returns throughput, iteration
    time, stall time, link utilisation, HBM peak, tokens and drafts per verify. ``max_draft``: the
    longest draft Admit may schedule (default: the lookahead window) - e.g. the longest measured,
    so acceptance is never extrapolated far beyond the data."""
    if policy not in ("staggered", "lockstep", "lockstep_prefetch"):
        raise ValueError(f"unknown policy {policy!r}")
    rng = np.random.default_rng(seed)
    M, C = hw.model_bytes, hw.hbm_bytes
    resident = M + B * c * kv_full
    if resident + kv_full > C:
        return {"policy": policy, "feasible": False, "B": B, "x": x, "c": c,
                "reason": "compressed caches + one full cache exceed HBM"}
    t_est = max(eq3_iter_time(hw, B, kv_full, c, x))
    xfer_s = kv_full / hw.bw_link
    S = max(1, math.ceil(xfer_s / t_est))
    window = max(window, x + S + 2)

    # per-request state
    verify_at: list = [None] * B  # iteration of the next verify (None: not scheduled)
    drafted = [0] * B
    xfer_done = [math.inf] * B  # time its transfer finishes
    in_hbm = [False] * B  # its full cache is in HBM (or on its way)
    bw, hbm = _Ring(), _Ring()

    d_max = window - 1 if max_draft is None else max(S, min(window - 1, int(max_draft)))

    def admit(r, now):
        anchor = min(max(x, S), d_max)
        cands = [anchor]
        for delta in range(1, window):
            for d in (anchor - delta, anchor + delta):
                if S <= d <= d_max:
                    cands.append(d)
        share = xfer_s / S
        for d in cands:
            span = range(now + d - S, now + d)
            if all(bw.get(i) + share <= t_est * (1 + 1e-9) for i in span) and \
                    all(resident + hbm.get(i) + kv_full <= C for i in range(now + d - S, now + d + 1)):
                for i in span:
                    bw.add(i, share)
                for i in range(now + d - S, now + d + 1):
                    hbm.add(i, kv_full)
                verify_at[r] = now + d
                return True
        return False

    now_t = 0.0
    link_free = 0.0
    tokens = stall = link_busy = 0.0
    verifies = emitted_sum = idle_iters = drafts_sum = 0
    hbm_peak = resident
    waiting: set = set()
    lock = policy != "staggered"
    if lock:
        for r in range(B):
            verify_at[r] = x
    else:
        waiting = set(range(B))  # admitted at the first iteration, one after another
    for it in range(iterations):
        if not lock:
            for r in sorted(waiting):
                if admit(r, it):
                    waiting.discard(r)
        # issue transfers (each occupies HBM from now until its verify ends)
        for r in range(B):
            if verify_at[r] is None or in_hbm[r]:
                continue
            if policy != "lockstep_prefetch" and it < verify_at[r] - S:
                continue
            if resident + sum(kv_full for q in range(B) if in_hbm[q]) + kv_full > C:
                continue  # no room yet
            start = max(now_t, link_free)
            link_free = start + xfer_s
            link_busy += xfer_s
            xfer_done[r] = link_free
            in_hbm[r] = True
        due = [r for r in range(B) if verify_at[r] is not None and verify_at[r] <= it]
        ver = [r for r in due if in_hbm[r]]
        if lock:  # lock-step: nobody drafts until every request of the round has verified
            drafting = [] if due else [r for r in range(B) if verify_at[r] is not None]
        else:  # a due request whose cache is not in yet keeps drafting
            drafting = [r for r in range(B) if r not in ver and r not in waiting]
        idle_iters += B - len(drafting) - len(ver)
        start_t = max([now_t] + [xfer_done[r] for r in ver])
        stall += start_t - now_t
        hbm_peak = max(hbm_peak, resident + sum(kv_full for q in range(B) if in_hbm[q]))
        t_gpu = (M + len(drafting) * c * kv_full + len(ver) * kv_full) / hw.bw_hbm
        now_t = start_t + t_gpu
        for r in drafting:
            drafted[r] += 1
        for r in ver:
            drafts_sum += drafted[r]
            e = accept.emitted(drafted[r], rng)
            tokens += e
            emitted_sum += e
            verifies += 1
            drafted[r] = 0
            in_hbm[r] = False
            xfer_done[r] = math.inf
            verify_at[r] = None
            if not lock and not admit(r, it + 1):
                waiting.add(r)
        if lock and all(v is None for v in verify_at):
            for r in range(B):
                verify_at[r] = it + 1 + x
        bw.trim(it)
        hbm.trim(it)
    return {"policy": policy, "feasible": True, "B": B, "x": x, "c": c, "S_windows": S,
            "tokens_per_s": tokens / now_t if now_t else 0.0, "iter_ms": 1e3 * now_t / iterations,
            "stall_frac": stall / now_t if now_t else 0.0, "link_util": min(1.0, link_busy / now_t) if now_t else 0.0,
            "hbm_peak_gb": hbm_peak / 1e9, "tokens_per_verify": emitted_sum / verifies if verifies else 0.0,
            "drafts_per_verify": drafts_sum / verifies if verifies else 0.0,
            "verifies": verifies, "idle_request_iters": idle_iters, "eq3_t_iter_ms": 1e3 * t_est,
            "hardware": asdict(hw), "kv_full_gb": kv_full / 1e9}
