"""kvz as vLLM's KV store: a V1 KV connector that stores computed KV blocks as ``.kvz`` and loads
them for repeated prefixes.

::

    from vllm import LLM
    llm = LLM(model=..., kv_transfer_config={
        "kv_connector": "KvzConnector",
        "kv_connector_module_path": "kvz.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "/var/cache/kvz-vllm",     # or redis://host:6379/0
                                      "target_kl": "fp8", "lossless": False, "bank": "gemma-3-270m"}})

``kv_connector_extra_config`` keys: ``store`` (a directory path or a ``redis://`` URL; default
``~/.cache/kvz/vllm``), ``target_kl`` (the error budget: a mean next-token KL, or ``"fp8"``, the
default: FP8 e4m3's KL, in the attention scope from the bank's statistics; docs/engine-scope.md),
``any_prefix`` (default True: every block prefix of a stored run stays within the budget; False
codes positions a sliding-window layer never reads again after the run's end more coarsely),
``eps`` (instead of ``target_kl``: an NRMSE bound per tensor, the tensor scope), ``lossless`` (add the
refinement tier: the blocks decode to the engine's bits exactly), ``profile`` (the speed profile
saves are coded in: ``auto`` (default: measured at warm-up, see
:mod:`~kvz.integrations.vllm.profile_choice`), ``default``, ``balanced`` or ``fast``; a reader
needs no setting, a ``.kvz`` says how it was coded), ``bank`` (a registry name or path; default
``gemma-3-270m`` when the model is Gemma 3 270M, else none), ``model_id`` (in every key, with
the weights' fingerprint; default the served model name), ``budget_bytes`` (store budget), ``namespace`` (Redis),
``threads`` (kvz's encode threads), ``load_cores`` (the cores kvz's load thread runs on, a CPU
list like ``"2-3"``; default: the cores vLLM's CPU worker does not bind — those not in
``VLLM_CPU_OMP_THREADS_BIND`` — or all cores when it binds every one), ``decode_threads`` (threads
one load decodes with; default one per load core), ``idle_cores`` (with the decode process: cores
it may also decode on at idle priority, so only while the engine's thread there sleeps — as the
forward does while it waits for a layer; default ``auto``: the cores that are not load cores;
``none`` to switch off; :func:`~kvz.integrations.vllm.loader.idle_cores`), ``load_deadline_s``
(default 30: a step's loads not complete by then are cancelled and recomputed), ``layerwise`` (default True: the forward
waits per layer; False: every load completes before the forward starts), ``decode_process``
(default False: in the load thread; True: in kvz's own process, out of the engine's GIL,
:mod:`~kvz.integrations.vllm.decode_worker`: slower on an 8K hit on Zen 5, docs/vllm.md),
``window_loads`` (``auto``/``on``/``off``: :mod:`~kvz.integrations.vllm.window`), ``switch_interval_s``
(default 0.0002: the load thread's interpreter switch interval; :class:`~kvz.integrations.vllm.loader.StepLoad`),
``sync_save`` (encode in the step, not in a background thread), ``read_only``, ``store_after_lossy``
(also store blocks computed on top of lossy loaded KV; default off: a prefix hit then stays within
eps of what the model computes), ``debug_dir`` (write the KV read back from the engine's blocks
after each load/save, for tests).

How it works (scheduler side, worker side, failures): ``docs/vllm.md``, "Inside the connector".
"""
from __future__ import annotations

import os
import queue
import re
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from kvz.integrations.kvstore import open_url

from .meta import KvzConnectorMetadata, LoadSpec, RequestState, SaveSpec
from .model import model_info
from .paged import PagedLayout, debug_dump
from .store import DEFAULT_STORE, BlockStore, warn
from .window import load_starts, window_setting

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["KvzConnector", "KvzConnectorMetadata", "model_info"]

# ============================================================================ the connector

def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


class KvzConnector(KVConnectorBase_V1):
    """See the module docstring."""

    #: seconds the scheduler side spent in store lookups (fetch + checks), summed over the instances of
    #: this process (with the engine in-process the worker's instance and the harness can read it)
    scheduler_timings = {"lookup_s": 0.0}

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        get = self._kv_transfer_config.get_from_extra_config
        self.block_size = int(vllm_config.cache_config.block_size)
        info = model_info(vllm_config)
        self.info = info
        lossless = bool(get("lossless", False))
        eps = get("eps", None)  # None: the store's default budget, target_kl in the attention scope
        eps = None if eps is None else float(eps)
        target_kl = get("target_kl", None)
        any_prefix = bool(get("any_prefix", True))
        bank = get("bank", info["bank"])
        threads = get("threads", None)
        self.sync_save = bool(get("sync_save", False))
        self.store_after_lossy = bool(get("store_after_lossy", False))
        self.read_only = bool(get("read_only", False))
        self.debug_dir = get("debug_dir", None)
        self.warmup = bool(get("warmup", True))
        self._warm = None  # the warm-up's future (kvz's load thread)
        self.profile_setting = str(get("profile", "auto"))
        if self.profile_setting not in ("auto", "default", "balanced", "fast"):
            raise ValueError(f"kvz connector: unknown profile {self.profile_setting!r} "
                             "(auto, default, balanced or fast)")
        self.profile_choice: dict = {"profile": None if self.profile_setting == "auto" else self.profile_setting,
                                     "setting": self.profile_setting, "reason": "as configured"}
        kw: dict[str, Any] = {k: f(get(k, None)) for k, f in (("budget_bytes", int), ("namespace", str))
                              if get(k, None) is not None}
        store_url = str(get("store", None) or DEFAULT_STORE)
        self.backend = open_url(store_url, **kw)
        settings = dict(model_id=get("model_id", info["model_id"]), block_size=self.block_size,
                        layer_types=info["layer_types"], rope_theta=info["rope_theta"], shape=info["shape"],
                        dtype=info["dtype"], eps=eps, target_kl=target_kl, any_prefix=any_prefix,
                        lossless=lossless, bank=bank, weights=info["weights"],
                        threads=None if threads is None else int(threads),
                        profile="default" if self.profile_setting == "auto" else self.profile_setting)
        self.store = BlockStore(self.backend, **settings)
        # kvz's decode process (decode_worker): the same store and settings, opened there
        self.decode_process = bool(get("decode_process", False))
        self._decoder_args = (store_url, kw, settings)
        self._decoder: Any = None
        self.lossy = not lossless
        # scheduler side
        self._lookups: dict[str, tuple[int, int, list]] = {}  # req -> (num_computed, hit blocks, segments)
        self._pending_loads: dict[str, tuple[int, list]] = {}
        self._reqs: dict[str, RequestState] = {}
        # worker side
        self._kv: list[tuple[str, torch.Tensor]] = []
        self._paged: PagedLayout = None  # type: ignore[assignment]  # set by register_kv_caches, before any load
        self._load_errors: set[int] = set()
        self._step: Any = None  # the step's StepLoad while it loads
        self._step_waited: set[int] = set()
        self._layer_of: dict[str, int] = {}
        self._load_pool: ThreadPoolExecutor | None = None
        self._load_future = None
        self.layerwise = bool(get("layerwise", True))
        self.windows, self.window_reason = window_setting(
            info["layer_types"], getattr(vllm_config.model_config.hf_text_config, "sliding_window", None),
            bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True)), str(get("window_loads", "auto")))
        self.load_deadline_s = float(get("load_deadline_s", 30.0))
        sw = get("switch_interval_s", 2e-4)  # see the module docstring
        self.switch_interval_s = None if sw in (None, 0, "0") else float(sw)
        from .loader import idle_cores, load_cores

        self.load_cores, self.load_cores_reason = load_cores(get("load_cores", None))
        self.decode_threads = int(get("decode_threads", None) or len(self.load_cores))
        self.idle_cores, self.idle_cores_reason = idle_cores(get("idle_cores", None), self.load_cores) \
            if self.decode_process else ([], "none (decode_process off: loads decode in the load thread)")
        self._save_q: queue.Queue | None = None
        self._save_thread: threading.Thread | None = None
        self.timings = {"load_s": 0.0, "decode_s": 0.0, "copy_s": 0.0, "read_s": 0.0, "blocked_s": 0.0,
                        "extract_s": 0.0, "loaded_blocks": 0, "failed_blocks": 0, "load_steps": 0}
        logger.info("kvz connector (%s): store %s, %s, lossless %s, bank %s", role.name,
                    type(self.backend).__name__, self.store.budget.describe(), lossless, bank)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        ids = list(request.prompt_token_ids or [])
        if not ids or getattr(request, "mm_features", None):
            return 0, False
        bs = self.block_size
        max_blocks = (len(ids) - 1) // bs
        start = num_computed_tokens // bs
        cached = self._lookups.get(request.request_id)
        if cached is not None and cached[0] == num_computed_tokens:
            hit = cached[1]
        else:
            t0 = time.perf_counter()
            hit, segs = self.store.lookup(ids, max_blocks, start_block=start)
            KvzConnector.scheduler_timings["lookup_s"] += time.perf_counter() - t0
            self._lookups[request.request_id] = (num_computed_tokens, hit, segs)
        ext = hit * bs - num_computed_tokens
        return (ext if ext > 0 else 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        got = self._lookups.pop(rid, None)
        if num_external_tokens > 0 and got is not None:
            _, hit, segs = got
            self._pending_loads[rid] = (hit, segs)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvzConnectorMetadata()
        st: RequestState | None
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.prompt_token_ids or [])
            st = RequestState(ids, list(new.block_ids[0]), len(ids))
            self._reqs[new.req_id] = st
            pl = self._pending_loads.pop(new.req_id, None)
            if pl is not None:
                hit, segs = pl
                st.hit_blocks = hit
                st.lossy_load = self.lossy
                meta.loads.append(LoadSpec(new.req_id, segs, list(st.block_ids)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb is not None else []
                st.saved = True  # resumed after preemption: its blocks were recomputed, nothing new to store
                self._pending_loads.pop(rid, None)
            elif nb is not None:
                st.block_ids.extend(nb[0])
        # store each prompt in the step its prefill completes
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._maybe_save(meta, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0))
        for i, rid in enumerate(cached.req_ids):
            self._maybe_save(meta, rid, cached.num_computed_tokens[i] + sched.get(rid, 0))
        self._pending_loads.clear()
        return meta

    def _maybe_save(self, meta, rid, end):
        st = self._reqs.get(rid)
        if st is None or st.saved or end < st.prompt_len:
            return
        st.saved = True
        if self.read_only:
            return
        if st.lossy_load and st.hit_blocks and not self.store_after_lossy:
            return
        bs = self.block_size
        full = min(st.prompt_len // bs, len(st.block_ids))
        first = self.store.stored_prefix(st.token_ids, full)
        if first >= full:
            return
        hashes = self.store.block_hashes(st.token_ids, full)[first:]
        meta.saves.append(SaveSpec(rid, st.token_ids[:full * bs], first, st.block_ids[first:full], hashes))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._lookups.pop(rid, None)
        self._pending_loads.pop(rid, None)
        return False, None

    # ------------------------------------------------------------------ worker side: layout
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        items = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        self._kv = items
        self._layer_of = {name: i for i, (name, _) in enumerate(items)}
        self._paged = PagedLayout(items, self.block_size, self.info["shape"],
                                  self._vllm_config.cache_config.cache_dtype)
        logger.info("kvz connector: loads on cores %s (%s), %d decode thread(s), idle-priority cores %s (%s), "
                    "deadline %g s, layerwise %s, windows: %s", self.load_cores, self.load_cores_reason,
                    self.decode_threads, self.idle_cores, self.idle_cores_reason, self.load_deadline_s, self.layerwise,
                    self.window_reason)
        if self.warmup or self.profile_setting == "auto" or self.decode_process:
            self._warm = self._load_thread_pool().submit(self._warm_up)

    def _warm_up(self) -> None:
        """In kvz's load thread, on the cores loads run on: compile (or load from numba's cache) the
        codec's kernels, and with profile ``auto`` measure and choose (:mod:`.profile_choice`)."""
        try:
            if self.warmup:
                self.timings["warmup_s"] = self.store.warmup()
        except Exception as e:  # noqa: BLE001
            warn(f"kvz: codec warm-up failed ({type(e).__name__}: {e})")
        if self.decode_process:
            from .decode_worker import start_worker

            self._decoder = start_worker(*self._decoder_args, self.load_cores, self.decode_threads,
                                         int(self._vllm_config.model_config.max_model_len), warn=warn,
                                         idle_cores=self.idle_cores)
            if self._decoder is not None:
                self.timings["decode_process_warmup_s"] = self._decoder.warmup_s
        if self.profile_setting != "auto":
            return
        if self.read_only:
            self.profile_choice = {"profile": None, "setting": "auto", "reason": "read-only: this engine never saves"}
            return
        from .profile_choice import choose_profile

        self.profile_choice = choose_profile(self.store, self.backend, self.info["shape"],
                                         int(self._vllm_config.model_config.max_model_len))
        logger.info("kvz connector: profile auto -> %s", self.profile_choice["reason"])

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the codec warm-up (and the ``auto`` profile choice) started at registration."""
        if self._warm is not None:
            try:
                self._warm.result(timeout)
            except Exception:  # noqa: BLE001 - reported by the warm-up itself
                pass

    def stats(self) -> dict:
        """What this connector did: the worker's timings (``load_s`` wall time of loads, ``decode_s``,
        ``read_s``, ``copy_s``, ``blocked_s``: the forward's time waiting on loads), the store's
        counters, the load cores and the profile choice (``auto``: with its measurements)."""
        dp = None if self._decoder is None else {"placement": self._decoder.placement, "error": self._decoder.error}
        return {"timings": dict(self.timings), "counters": dict(self.store.counters),
                "profile": dict(self.profile_choice), "load_cores": list(self.load_cores),
                "load_cores_reason": self.load_cores_reason, "idle_cores": list(self.idle_cores),
                "idle_cores_reason": self.idle_cores_reason, "decode_process": dp, "layerwise": self.layerwise,
                "window_loads": self.window_reason, "load_deadline_s": self.load_deadline_s}

    # ------------------------------------------------------------------ worker side: load
    def _load_thread_pool(self):
        """kvz's load thread, pinned to :attr:`load_cores` (made on first use)."""
        if self._load_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            cores = set(self.load_cores)

            def pin():
                try:
                    os.sched_setaffinity(0, cores)  # this thread only (Linux); the threads it starts inherit it
                except (AttributeError, OSError) as e:
                    warn(f"kvz: could not pin the load thread to cores {sorted(cores)} ({e})")

            self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvz-load", initializer=pin)
        return self._load_pool

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvzConnectorMetadata) or not meta.loads:
            return
        self.wait_ready()
        from .loader import LoadJob, StepLoad

        bs = self.block_size
        _, H, d = self.info["shape"]
        dt = self._kv[0][1].dtype
        jobs: list[LoadJob] = []
        staging: dict = {}
        proc = None
        starts = load_starts(self.windows, meta.loads, bs)  # (request, first block) -> layer -> first position
        if self._decoder is not None:  # kvz's decode process (None: the load thread decodes)
            proc = self._decoder.try_submit([(seg, seg.count * bs, starts[(spec.req_id, seg.first)])
                                             for spec in meta.loads for seg in spec.segments],
                                            time.monotonic() + self.load_deadline_s, warn)
            if proc is None and not self._decoder.alive:
                self._decoder = None
        for spec in meta.loads:
            end = spec.segments[-1].first + spec.segments[-1].count if spec.segments else 0
            for seg in spec.segments:
                st = starts[(spec.req_id, seg.first)]
                blocks = spec.block_ids[seg.first:seg.first + seg.count]
                n = seg.count * bs
                bufs: dict = {}  # layer -> this job's staging tensors (the reader writes into them)
                j = len(jobs)
                opener = (lambda deadline, j=j: (proc.reader(j), None, proc)) if proc is not None else \
                    (lambda deadline, seg=seg, st=st: self.store.open_segment(seg, deadline, self.decode_threads,
                                                                              starts=st))
                jobs.append(LoadJob(
                    spec.req_id, blocks, spec.block_ids[seg.first:end], opener,
                    out=lambda i, n=n, bufs=bufs: bufs.setdefault(
                        i, (torch.empty((H, n, d), dtype=dt), torch.empty((H, n, d), dtype=dt))), starts=st))
                staging[id(jobs[-1])] = bufs
        if not jobs:
            return
        slots = {}
        for job in jobs:
            slots[id(job)] = (torch.as_tensor(job.blocks, dtype=torch.int64)[:, None] * bs
                              + torch.arange(bs, dtype=torch.int64)[None, :]).reshape(-1)

        def write(job, i, k, v):  # the layer's staging tensors [kv_heads, n, d] -> [n, kv_heads, d]
            kt, vt = staging[id(job)].pop(i, (k, v))  # the decode process's views: (k, v) as given
            self._paged.write(i, kt.transpose(0, 1).contiguous(), vt.transpose(0, 1).contiguous(), slots[id(job)])

        step = StepLoad(jobs, len(self._kv), write, self.load_deadline_s, warn=warn,
                        switch_interval_s=self.switch_interval_s, proc=proc)
        self._step = step
        self._step_waited = set()
        self._load_future = self._load_thread_pool().submit(step.run)
        if not self.layerwise:  # everything in place before the forward starts
            step.wait(len(self._kv) - 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        i = self._layer_of.get(layer_name)
        if i is None:
            i = _layer_index(layer_name)
        if i < 0:
            return
        self._step_waited.add(i)
        step.wait(i)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        step, self._step = self._step, None
        if step is not None:
            waited_all = self.layerwise is False or len(self._step_waited) == len(self._kv)
            if not waited_all and self.layerwise:
                warn("kvz: the forward did not wait for every layer's load (this attention backend does not call "
                     "wait_for_layer_load): this step's loaded blocks are recomputed and later loads complete "
                     "before the forward (layerwise off)")
                self.layerwise = False
            out |= step.finish(waited_all)
            self._account(step)
        return out

    def _account(self, step) -> None:
        t = self.timings
        wall = step.layer_ready_s[-1] if step.layer_ready_s else 0.0
        proc = step.proc
        t["decode_s"] += proc.decode_s if proc is not None else step.decode_s  # the process's own seconds
        t["copy_s"] += step.copy_s
        t["load_s"] += wall
        t["blocked_s"] += step.blocked_s
        t["read_s"] += sum(j.read_s for j in step.jobs)
        t["loaded_blocks"] += sum(len(j.blocks) for j in step.jobs if j.failed is None)
        t["failed_blocks"] += sum(len(j.blocks) for j in step.jobs if j.failed is not None)
        t["load_steps"] += 1
        if self.debug_dir:
            by_req: dict = {}
            for job in step.jobs:
                if job.failed is None:
                    by_req.setdefault(job.req_id, []).extend(job.blocks)
            for rid, blocks in by_req.items():
                debug_dump(self.debug_dir, "load", rid, lambda b=blocks: self._paged.read_blocks(b), 0,
                           self.block_size, warn)

    # ------------------------------------------------------------------ worker side: save
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # all layers are encoded together after the forward (wait_for_save)

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvzConnectorMetadata) or not meta.saves:
            return
        for spec in meta.saves:
            t0 = time.perf_counter()
            try:
                kv = self._paged.read_blocks(spec.block_ids)
            except Exception as e:  # noqa: BLE001
                warn(f"kvz: reading blocks of {spec.req_id} failed ({type(e).__name__}: {e}); not stored")
                continue
            self.timings["extract_s"] += time.perf_counter() - t0
            if self.debug_dir:
                debug_dump(self.debug_dir, "save", spec.req_id, kv, spec.first_block, self.block_size, warn)
            job = (spec.token_ids, spec.first_block, kv, spec.hashes)
            if self.sync_save:
                self.store.put_run(*job)
            else:
                self._saver().put(job)

    def _saver(self) -> queue.Queue:
        if self._save_q is None:
            q: queue.Queue = queue.Queue()
            self._save_q = q

            def run():
                self.wait_ready()  # the profile (auto) is chosen before the first save
                while True:
                    job = q.get()
                    try:
                        if job is None:
                            return
                        self.store.put_run(*job)
                    finally:
                        q.task_done()

            self._save_thread = threading.Thread(target=run, name="kvz-save", daemon=True)
            self._save_thread.start()
            import atexit

            atexit.register(self.flush)
        return self._save_q

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued block run is stored (and the warm-up is done)."""
        self.wait_ready()
        if self._save_q is not None:
            self._save_q.join()

    def shutdown(self):
        if self._save_q is not None:
            self.flush()
            self._save_q.put(None)
            if self._save_thread is not None:
                self._save_thread.join(timeout=60)
            self._save_q = None
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001
            pass
        return None
