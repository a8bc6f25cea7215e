"""Continuous batching under three memory policies, over the same budgets.

Each step the scheduler (host side, between jitted steps) makes every running request's next tail page
writable, admits waiting requests while the budgets allow, and hands out at most `prefill_chunk` prompt
tokens to prefilling requests. What happens when the device KV pool runs out is the policy:

* `preempt`  — all KV on the device; the newest running request is preempted (its KV dropped) and
               recomputed when readmitted (vLLM's default).
* `offload`  — traditional offloading: the newest running request is swapped to the host whole (its pages
               are mirrored there already) and must be swapped back whole before it decodes again.
* `hisparse` — requests release their coldest written-back pages (never the two tail pages), keep a hot
               buffer for what the indexer asks for, and keep decoding. Admission checks the device budget
               (indexer pages + hot buffers + tail pages, the prompt resident while it is prefilled) and the
               host budget; a request that does not fit waits (never fails).

Admission under preempt / offload is one of `ADMISSIONS`:

* `vllm` (the default) — as vLLM's scheduler: a request is admitted when the pages of its prompt (plus the
               lookahead and one growth page) are free on the device, in the KV pool and the indexer pool alike
               (the DSA indexer's keys are one more KV cache group on the same block table); it then grows page
               by page. When a running request cannot get its next page the newest admitted running request is
               preempted (preempt) or swapped out whole (offload), KV and keys; no request is admitted while one
               is swapped out. The host pool (offload's swap space) is still reserved for the whole length.
* `reserve` — conservative: admitted only when the indexer pages of its whole length fit beside every admitted
               request's (the indexer pool has as many pages as the device pool, so an admitted request can always
               grow to its end: the pressure stays in the waiting queue, and nothing is preempted or swapped).

HiSparse keeps its own rule whatever `admission` says (its keys never leave the device: the indexer pages of
every admitted request's whole length, next to the device floor).

Offload under `vllm`: this store keeps no host copy of indexer keys, so a swapped-out request's keys stay in the
store's key pool (`policy_cache` gives it room for every host page's keys) and only leave the device *budget*
(`Scheduler.device_keys`): the copy vLLM would make is counted (`StepPlan.swap_out_keys` / `swap_in_keys`),
not performed.

With prefix caching on (`PageManager.prefix_caching`), a waiting request whose prompt starts with registered
full pages shares them at admission and prefills only the rest, through the store (even in "whole" mode: the
shared rows are read back from the store, so the rest is written chunk by chunk with the prompt resident;
when the device cannot hold the prompt now but a whole prefill fits, it is prefilled whole without sharing).
A prompt written chunk by chunk gets all its pages at admission (resident until written): its chunks never wait
for pages, and the device floor of later admissions counts them.

A request that does not progress in a step (no decode row, no prompt rows) has a stated reason in the step's plan
(`StepPlan.waits`, one of `WAIT_REASONS`); the engine counts them per step (`StepMetrics.wait_reasons`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from hisparse_jax.config import CacheConfig
from hisparse_jax.engine.request import Request, RequestState
from hisparse_jax.kv.account import index_codebook_bytes
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.pool import OutOfPages, Tier
from hisparse_jax.kv.spec import TAIL_PAGES, BudgetError, min_device_pages
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.units import INVALID

POLICIES = ("preempt", "offload", "hisparse")
ADMISSIONS = ("vllm", "reserve")  # how preempt / offload admit (see the module docstring); HiSparse has its own
# chunked: prompt rows go through the store with the decode batch (the prompt stays resident while it is
# written, since its rows read each other's top-k); whole: one full causal forward per prompt, written straight
# into the store — under HiSparse only the tail pages need to be on the device.
PREFILL_MODES = ("chunked", "whole")
# Why a request made no progress in a step (`StepPlan.waits`). Waiting requests: the first in the queue says what
# keeps it out, the rest are "queued" behind it. Admitted ones: swapped out (this step, or still not back), or
# their prompt got no rows this step. Preempted ones are back in the queue.
WAIT_REASONS = {
    "max_running": "max_running requests are admitted already (or every request slot is in use)",
    "device_budget": "the device pool cannot hold it now (HiSparse: next to the admitted requests' floor)",
    "index_budget": "the indexer pool cannot hold its pages next to what the admitted requests may grow to",
    "host_budget": "the host pool cannot hold its pages next to what the admitted requests may grow to",
    "prefill_busy": "another prompt is being written through the store (one at a time)",
    "queued": "behind an earlier waiting request (first come, first served)",
    "preempted": "preempted this step (its KV dropped; recomputed when readmitted)",
    "swapped_out": "swapped out to the host this step",
    "swap_in": "swapped out; its whole KV does not fit on the device yet",
    "swapped_first": "a swapped-out request comes back before a new one is admitted (admission 'vllm')",
    "prefill_chunk": "this step's prompt tokens (prefill_chunk) went to earlier prompts",
}


def check_admission(admission: str) -> str:
    """`admission`, refused (ValueError) unless one of `ADMISSIONS`."""
    if admission not in ADMISSIONS:
        raise ValueError(f"unknown admission {admission!r}; choose one of {', '.join(ADMISSIONS)}")
    return admission


def swaps_keys(cache, policy: str, admission: str) -> bool:
    """Whether a swap-out takes the request's indexer keys off the device budget too (offload under "vllm", keys
    on the device: vLLM swaps every KV cache group of a request)."""
    return policy == "offload" and admission == "vllm" and cache.index_tier == "device"


def policy_cache(cache, policy: str, max_running: int, speculative_tokens: int = 0, admission: str = "vllm"):
    """The `CacheConfig` a policy's store is built from: `max_running` request slots, the speculative rows, and
    no host mirror under preempt (it never uses the host tier). Formats change with the cache's capacity
    (`CacheConfig.with_formats`), so a capacity shared by several policies stays valid. When swaps take the keys
    off the device budget (`swaps_keys`) the key pool holds every host page's keys too (the budget on the device
    stays `cache.num_index_pages`: `Scheduler(device_keys=...)`), its capacity grown to match."""
    if policy == "preempt":
        cache = cache.with_formats(mirror_to_host=False)
    cache = cache.with_formats(speculative_tokens=speculative_tokens).replace(max_seqs=max_running)
    if swaps_keys(cache, policy, check_admission(admission)):
        n = max(cache.num_index_pages, cache.host_pages)
        cap = cache.capacity
        if cap is not None and cap.num_index_pages < n:
            cap = cap.replace(index_pages=n)
        cache = cache.replace(index_pages=n, capacity=cap)
    return cache


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PAGE_SIZE)


def device_budget(model_cfg, cache: CacheConfig, device_bytes: int, policy: str, *, max_running: int,
                  max_len: int, prefill: str = "chunked") -> CacheConfig:
    """Split one device byte budget into KV pages and indexer pages, as a shared pool would for `policy`.

    preempt / offload keep every page whole on the device: one KV page + one indexer page per 64 tokens.
    hisparse keeps every request's indexer keys resident, plus two tail pages and a hot buffer per running
    request, plus (chunked prefill) one prompt resident while it is prefilled: the indexer pool is sized for
    as many requests
    as that leaves room for (at most `max_running`), the KV pool gets the rest. With index_summary="rvq" its
    codebooks (`kv.account.index_codebook_bytes`) come off the budget first, whatever the policy.
    """
    spec = StoreSpec.create(model_cfg, cache.replace(device_pages=1, index_pages=1, capacity=None))
    device_bytes = max(device_bytes - index_codebook_bytes(spec), 0)
    kv_page = spec.page_bytes * spec.num_layers
    idx_page = 64 * spec.num_indexer_layers * spec.index_row_bytes
    n = pages(max_len)
    if policy != "hisparse":
        p = device_bytes // (kv_page + idx_page)
        return cache.replace(device_pages=int(p), index_pages=int(p))
    per_request = n * idx_page + (2 + spec.hot_pages) * kv_page
    reserve = (n + 1) * kv_page if prefill == "chunked" else 0
    c = max(1, min(max_running, (device_bytes - reserve) // per_request))
    index_pages = c * n
    return cache.replace(device_pages=int((device_bytes - index_pages * idx_page) // kv_page),
                         index_pages=int(index_pages))


@dataclasses.dataclass
class StepPlan:
    decode: list[Request]  # one row each: feed output[-1]
    prefill: list[tuple[Request, int, int]]  # (request, start, length) rows of kv_tokens, through the store
    preempted: list[Request]
    swapped_out: list[Request]
    swapped_in: list[Request]
    whole: list[Request] = dataclasses.field(default_factory=list)  # one full causal forward each
    # pages swapped this step: KV pages released to the host / copied back to the device, and the
    # indexer pages whose keys left / re-entered the device budget (offload under "vllm": counted, not copied)
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    swap_out_keys: int = 0
    swap_in_keys: int = 0
    cached_tokens: int = 0  # prompt tokens shared by prefix caching in this step's admissions
    # request id -> why it makes no progress this step (a key of WAIT_REASONS): every waiting request, every
    # admitted one with no decode row, prompt rows or whole prefill, every one preempted
    waits: dict[str, str] = dataclasses.field(default_factory=dict)

    def wait_reasons(self) -> dict[str, int]:
        """Requests per wait reason this step."""
        out: dict[str, int] = {}
        for why in self.waits.values():
            out[why] = out.get(why, 0) + 1
        return out


class Scheduler:
    def __init__(self, manager: PageManager, policy: str, *, max_running: int, prefill_chunk: int,
                 prefill: str = "chunked", admission: str = "vllm", device_keys: int | None = None):
        """admission: one of `ADMISSIONS` (preempt / offload; HiSparse keeps its own rule); device_keys: the
        indexer pages the device budget holds when swaps take keys off it (`swaps_keys`; default: the key pool's)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {prefill!r}; choose one of {', '.join(PREFILL_MODES)}")
        self.manager, self.policy, self.prefill = manager, policy, prefill
        self.admission = check_admission(admission)
        self.grows = policy != "hisparse" and admission == "vllm"  # admitted on the prompt, grown page by page
        self.swaps_keys = swaps_keys(manager.cache, policy, admission)
        self.device_keys = manager.budget_spec.index_pages if device_keys is None else device_keys
        self.max_running, self.prefill_chunk = max_running, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted: PREFILLING, RUNNING or SWAPPED, in admission order
        # chunked admissions whose prompt pages could not be reserved although the budgets said they fit (the
        # request stays waiting, reason "device_budget"): a bookkeeping slip, counted so checks can see it
        self.admission_out_of_pages = 0

    # ----- budgets -------------------------------------------------------------------------------
    def _committed(self, tier: Tier) -> int:
        """Pages of `tier` (index / host) the admitted requests hold or may still need: the pages in use (a shared
        page counts once) plus every request's growth up to its max length."""
        c = self.manager
        return c.pool.num_used(tier) + sum(max(pages(r.max_kv_len) - c.requests[r.slot].num_pages, 0)
                                           for r in self.active)

    def _device_floor(self) -> tuple[int, set[int]]:
        """Device pages the admitted requests may need at once from now on, and the resident pages among them (a
        page shared by several requests counts once). Under preempt / offload a request keeps all its pages plus
        one (and a prompt being written the pages it has yet to get). Under HiSparse see `_least`: a prompt being
        written stays resident; a decoding request keeps its tail pages and its hot buffer, and (before it has a
        hot buffer) its shared pages; one that never needs to release a page keeps all of them. Admission keeps
        this floor within the device pool, and every request can reach its share of it by releasing pages (or
        the eviction of others') without waiting for a page that is not there: no `reserve` fails."""
        c = self.manager
        held: set[int] = set()
        extra = 0
        rc = c.pool.refcounts(Tier.DEVICE)
        for r in self.active:
            if r.state is RequestState.SWAPPED:
                continue
            rp = c.requests[r.slot]
            resident = [d for d in rp.device if d != INVALID]
            if self.policy != "hisparse":
                held.update(resident)
                todo = pages(len(r.kv_tokens)) - rp.num_pages if r.state is RequestState.PREFILLING else 0
                extra += 1 + len(rp.host_only_pages()) + max(todo, 0)
                continue
            shared = {d for d in resident if rc[d] > 1}
            tail = {d for d in rp.device[-TAIL_PAGES:] if d != INVALID}
            n_max = max(pages(r.max_kv_len), rp.num_pages)
            if rp.hot:  # its tail and hot buffer; a shared tail page stays with its other holders when it moves on
                keep = tail & shared
                need = len(keep) + TAIL_PAGES + c.budget_spec.hot_pages
            else:
                writing = r.slot in c.resident_only  # a prompt being written: all its pages resident meanwhile
                now = max(pages(len(r.kv_tokens)), rp.num_pages) if writing else len(resident)
                need = self._least(now if writing else 0, n_max, len(shared), len(shared & tail), len(resident))
                whole = min_device_pages(c.budget_spec, n_max, releasable=c.releasable) >= n_max
                keep = set(resident) if writing or whole else shared
            held.update(keep)
            extra += max(need - len(keep), 0)
        return len(held) + extra, held

    def _least(self, now: int, n_max: int, n_shared: int, n_shared_tail: int, n_resident: int) -> int:
        """Device pages a HiSparse request without a hot buffer may need at once from now on (its own pages and
        its shared ones): `now` pages it must hold now (a prompt being written), `n_resident` resident, `n_max` at
        its longest, `n_shared` shared with other requests (`n_shared_tail` of them in its tail pages).

        One whose longest length fits its tail pages and a hot buffer never releases a page: n_max (unless the
        pool lends it a hot buffer to release a shared page together with its other holders: then tail + hot
        buffer). A longer one releases its own sealed pages once it has more than a hot buffer's worth of them
        (they pay for the buffer; before that it grows into free pages), and a shared one only after the pool has
        lent it the buffer: it needs at most its shared pages, its tail pages and a hot buffer's worth."""
        c = self.manager
        nh = c.budget_spec.hot_pages
        if min_device_pages(c.budget_spec, n_max, releasable=c.releasable) >= n_max:
            need = max(n_max, n_resident)
            if n_shared > n_shared_tail:
                need = max(need, n_shared_tail + TAIL_PAGES + nh)
            return max(need, now)
        return max(now, n_shared + TAIL_PAGES + nh)

    def can_admit(self, r: Request) -> bool:
        return self._admission(r) is not None

    def _admission(self, r: Request) -> str | None:
        """How `r` would be admitted now: "chunked" (its rows written through the store, prompt resident;
        shares its cached prefix when prefix caching is on), "whole" (one forward, nothing shared), or None."""
        return self._decide(r)[0]

    def _decide(self, r: Request) -> tuple[str | None, str]:
        """(`_admission`'s answer, and when it is None the reason `r` waits: a key of WAIT_REASONS)."""
        c = self.manager
        if len(self.active) >= self.max_running or not c.free_slots():
            return None, "max_running"
        if self.grows and any(x.state is RequestState.SWAPPED for x in self.active):
            return None, "swapped_first"
        hits = c.match_prefix(r.kv_tokens) if c.prefix_caching else []
        # preempt / offload: the prompt's pages and one growth page; a request admitted alone needs only the pages
        # of its prompt and first decode row. HiSparse: what it adds to the device floor (`_least`). Either way a
        # request alone needs no more than `Engine.add_request` checked, so one that fits alone never waits forever
        n_kv = len(r.kv_tokens)
        if self.active:
            prompt_pages = max(min(pages(n_kv) + 1, pages(r.max_kv_len)), pages(n_kv))
        else:
            prompt_pages = max(pages(n_kv), pages(min(n_kv + 1 + r.lookahead, r.max_kv_len)))
        short = self._short_tier(r, hits, prompt_pages)  # (a whole prefill shares nothing: its pages are all new)
        if short:
            return None, short
        hisparse = self.policy == "hisparse"
        n_max = max(pages(r.max_kv_len), pages(n_kv))
        # one prompt resident at a time while written through the store keeps the device floor predictable
        chunking = any(x.state is RequestState.PREFILLING and x.slot in c.resident_only for x in self.active)
        if r.imported is None and (self.prefill == "chunked" or hits):  # an import's rows arrive whole
            rc = c.pool.refcounts(Tier.DEVICE)
            if hisparse:  # what it adds to the floor; a hit page the floor holds already costs nothing more
                floor, held = self._device_floor()
                shared = sum(1 for x in hits if x.device != INVALID and rc[x.device] > 0)
                tail = sum(1 for i, x in enumerate(hits) if i >= pages(n_kv) - TAIL_PAGES
                           and x.device != INVALID and rc[x.device] > 0)
                need = self._least(pages(n_kv), n_max, shared, tail, pages(n_kv))
                fits = floor + need - sum(1 for x in hits if x.device in held) <= c.budget_spec.device_pages
            else:  # a hit page in use costs nothing; a cached one is revived out of the free pages
                new = prompt_pages - sum(1 for x in hits if x.device != INVALID and rc[x.device] > 0)
                fits = c.pool.num_free(Tier.DEVICE) >= new
            if fits:  # (a prefix hit waits for the prompt being written: its suffix is short to write)
                return (None, "prefill_busy") if chunking else ("chunked", "")
            if self.prefill == "chunked":
                return None, "device_budget"
            if hits and (short := self._short_tier(r, [], prompt_pages)):
                return None, short
        # whole: under HiSparse it adds its tail pages and a hot buffer (or all its pages when it never needs to
        # release one) to the floor
        fits = (self._device_floor()[0] + min_device_pages(c.budget_spec, n_max, releasable=c.releasable)
                <= c.budget_spec.device_pages if hisparse
                else c.pool.num_free(Tier.DEVICE) >= prompt_pages)
        return ("whole", "") if fits else (None, "device_budget")

    def _short_tier(self, r: Request, hits: list, prompt_pages: int) -> str:
        """The wait reason when the indexer or host pool cannot hold `r` next to the admitted requests, sharing the
        pages of `hits` (a hit page in use costs nothing); "" when both can. The host pool, and the indexer pool
        under "reserve" (and HiSparse), must hold `r` at its longest next to what the admitted requests may grow
        to; under "vllm" the indexer pool (and the device key budget, `swaps_keys`) must have `prompt_pages` of
        `r` free now, as the device pool must."""
        c = self.manager
        for tier, field in ((Tier.INDEX, "index"), (Tier.HOST, "host")):
            if tier is Tier.HOST and not c.spec.mirror_to_host:
                continue
            rc = c.pool.refcounts(tier)
            in_use = sum(1 for x in hits if getattr(x, field) != INVALID and rc[getattr(x, field)] > 0)
            if tier is Tier.INDEX and self.grows:
                new = prompt_pages - in_use
                if c.pool.num_free(tier) < new or (self.swaps_keys and self._keys_on_device() + new > self.device_keys):
                    return "index_budget"
            elif self._committed(tier) + pages(r.max_kv_len) - in_use > c.pool.budget(tier):
                return f"{field}_budget"
        return ""

    def _keys_on_device(self) -> int:
        """Indexer pages the device budget holds now: those of every admitted request not swapped out (a shared
        page once)."""
        c = self.manager
        return len({i for s, rp in c.requests.items() if s not in c.swapped for i in rp.index if i != INVALID})

    def _can_grow(self, r: Request, need: int) -> bool:
        """Whether `r` can have positions < need writable now without taking pages from anyone (the pools, and the
        device key budget when swaps take keys off it)."""
        c = self.manager
        if not c.can_reserve(r.slot, need):
            return False
        new = max(pages(need) - c.requests[r.slot].num_pages, 0)
        return not self.swaps_keys or self._keys_on_device() + new <= self.device_keys

    def check_ever_fits(self, rid: str, kv_len: int) -> None:
        """Refuse (BudgetError) a request of `kv_len` KV positions whose keys could never be on the device at once
        when swaps take keys off the device budget (the key pool itself is larger: `policy_cache`)."""
        if self.swaps_keys and pages(kv_len) > self.device_keys:
            raise BudgetError(f"request {rid!r} can never be admitted under 'offload': index_pages is too small: "
                              f"{pages(kv_len)} indexer pages on the device at once; index_pages is "
                              f"{self.device_keys}, {pages(kv_len) - self.device_keys} short")

    # ----- one step ------------------------------------------------------------------------------
    def schedule(self, step: int) -> StepPlan:
        plan = StepPlan([], [], [], [], [])
        c = self.manager
        # 1. swapped requests come back first (offload), when their whole KV fits again
        for r in [x for x in self.active if x.state is RequestState.SWAPPED]:
            rp = c.requests[r.slot]
            growth = 1 if pages(r.max_kv_len) > rp.num_pages else 0
            keys_fit = not self.swaps_keys or self._keys_on_device() + rp.num_pages + growth <= self.device_keys
            if keys_fit and c.pool.num_free(Tier.DEVICE) >= len(c.requests[r.slot].host_only_pages()) + growth:
                before = c.h2d_bytes
                c.swap_in(r.slot)  # (prefix pages still cached on the device are shared again, not copied)
                plan.swap_in_pages += (c.h2d_bytes - before) // c.all_layers_page_bytes
                plan.swap_in_keys += rp.num_pages if self.swaps_keys else 0
                r.state = RequestState.RUNNING
                plan.swapped_in.append(r)
        # 2. every running request needs its next position writable
        for r in list(self.active):
            if r.state is not RequestState.RUNNING:
                continue
            need = len(r.prompt) + len(r.output) + r.lookahead  # a speculative step writes past the pending token
            if not self._make_writable(r, need, plan):
                continue
            plan.decode.append(r)
        # 3. admit waiting requests (under "vllm" none in a step that preempted, as vLLM's scheduler)
        while self.waiting:
            r = self.waiting[0]
            mode, why = (None, "preempted") if self.grows and plan.preempted else self._decide(r)
            if mode is None:
                plan.waits.setdefault(r.request_id, why)  # (one preempted this step says so)
                break
            self.waiting.popleft()
            plan.waits.pop(r.request_id, None)  # (preempted earlier in this step, readmitted now)
            if mode == "whole":
                # the whole prompt's pages; under HiSparse older ones may start on the host
                r.slot = c.admit(len(r.kv_tokens), resident=self.policy != "hisparse")
                r.state, r.computed = RequestState.PREFILLING, 0
                self.active.append(r)
                plan.whole.append(r)
                continue
            r.slot = c.admit(0, tokens=r.kv_tokens)  # shares the cached prefix (resident) if there is one
            c.keep_resident(r.slot)
            try:  # every page of the prompt now: its chunks never wait for pages (the floor counted them)
                c.reserve(r.slot, len(r.kv_tokens))
            except OutOfPages:  # the budgets said it fits: not admitted after all, and counted (never silent)
                c.release(r.slot)
                r.slot = -1
                self.waiting.appendleft(r)
                self.admission_out_of_pages += 1
                plan.waits[r.request_id] = "device_budget"
                break
            r.state, r.computed = RequestState.PREFILLING, c.cached_tokens[r.slot]
            r.cached_tokens += r.computed
            plan.cached_tokens += r.computed
            self.active.append(r)
        for r in self.waiting:
            plan.waits.setdefault(r.request_id, "queued")
        # 4. prompt chunks (their pages were reserved at admission: `reserve` only checks)
        budget = self.prefill_chunk
        for r in self.active:
            if r.state is not RequestState.PREFILLING or r in plan.whole:
                continue
            if budget <= 0:
                plan.waits[r.request_id] = "prefill_chunk"
                continue
            todo = len(r.kv_tokens) - r.computed
            n = min(todo, budget)
            c.reserve(r.slot, r.computed + n)
            plan.prefill.append((r, r.computed, n))
            budget -= n
        for r in self.active:
            if r.state is RequestState.SWAPPED:
                plan.waits[r.request_id] = "swapped_out" if r in plan.swapped_out else "swap_in"
        return plan

    def _make_writable(self, r: Request, need: int, plan: StepPlan) -> bool:
        """Reserve the tail page of position need-1 for `r`, applying the policy when the device is full.
        Returns False when `r` itself was preempted or swapped out."""
        c = self.manager
        while True:
            if self.policy == "hisparse":
                c.reserve(r.slot, need)  # evicts cold pages (others' first) as needed
                return True
            if self._can_grow(r, need):
                c.reserve(r.slot, need)
                return True
            victim = self._newest_running(exclude_prefilling=True)
            if victim is None:
                raise OutOfPages(Tier.DEVICE, 1, c.pool.num_free(Tier.DEVICE), c.budget_spec.device_pages)
            if self.policy == "preempt":
                self._preempt(victim, plan)
            else:
                self._swap_out(victim, plan)
            if victim is r:
                return False

    def _newest_running(self, exclude_prefilling: bool):
        for x in reversed(self.active):
            if x.state is RequestState.RUNNING:
                return x
        return None

    def _preempt(self, r: Request, plan: StepPlan) -> None:
        self.manager.release(r.slot)
        self.active.remove(r)
        if r in plan.decode:
            plan.decode.remove(r)
        r.slot, r.computed, r.state = -1, 0, RequestState.WAITING
        r.preemptions += 1
        self.waiting.appendleft(r)
        plan.preempted.append(r)
        plan.waits[r.request_id] = "preempted"

    def _swap_out(self, r: Request, plan: StepPlan) -> None:
        plan.swap_out_keys += self.manager.requests[r.slot].num_pages if self.swaps_keys else 0
        plan.swap_out_pages += self.manager.swap_out(r.slot)
        r.state = RequestState.SWAPPED
        r.swaps += 1
        if r in plan.decode:
            plan.decode.remove(r)
        plan.swapped_out.append(r)

    def finish(self, r: Request, state: RequestState) -> None:
        if r in self.active:
            self.active.remove(r)
            self.manager.release(r.slot)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.slot, r.state = -1, state
