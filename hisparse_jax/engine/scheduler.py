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

With prefix caching on (`TieredCache.prefix_caching`), a waiting request whose prompt starts with registered
full pages shares them at admission and prefills only the rest, through the store (even in "whole" mode: the
shared rows are read back from the store, so the rest is written chunk by chunk with the prompt resident;
when the device cannot hold the prompt now but a whole prefill fits, it is prefilled whole without sharing).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from hisparse_jax.config import PAGE_SIZE
from hisparse_jax.engine.request import Request, RequestState
from hisparse_jax.kv.manager import TAIL_PAGES, TieredCache
from hisparse_jax.kv.pool import INVALID, OutOfPages, Tier

POLICIES = ("preempt", "offload", "hisparse")
# chunked: prompt rows go through the store with the decode batch (the prompt stays resident while it is
# written, since its rows read each other's top-k); whole: one full causal forward per prompt, written straight
# into the store — under HiSparse only the tail pages need to be on the device.
PREFILL_MODES = ("chunked", "whole")


def pages(n_tokens: int) -> int:
    return -(-n_tokens // PAGE_SIZE)


@dataclasses.dataclass
class StepPlan:
    decode: list[Request]  # one row each: feed output[-1]
    prefill: list[tuple[Request, int, int]]  # (request, start, length) rows of kv_tokens, through the store
    preempted: list[Request]
    swapped_out: list[Request]
    swapped_in: list[Request]
    whole: list[Request] = dataclasses.field(default_factory=list)  # one full causal forward each
    cached_tokens: int = 0  # prompt tokens shared from the prefix cache by this step's admissions


class Scheduler:
    def __init__(self, cache: TieredCache, policy: str, *, max_running: int, prefill_chunk: int,
                 prefill: str = "chunked"):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {prefill!r}; choose one of {', '.join(PREFILL_MODES)}")
        self.cache, self.policy, self.prefill = cache, policy, prefill
        self.max_running, self.prefill_chunk = max_running, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted: PREFILLING, RUNNING or SWAPPED, in admission order

    # ----- budgets -------------------------------------------------------------------------------
    def _committed(self, tier: Tier) -> int:
        """Pages of `tier` (index / host) the admitted requests hold or may still need: the pages in use (a shared
        page counts once) plus every request's growth up to its max length."""
        c = self.cache
        return c.pool.num_used(tier) + sum(max(pages(r.max_kv_len) - c.requests[r.slot].num_pages, 0)
                                           for r in self.active)

    def _device_floor(self) -> tuple[int, set[int]]:
        """Device pages the admitted requests cannot go below, and the resident pages among them (a page shared
        by several requests counts once). A prefilling request (or any under preempt / offload) keeps all its
        pages plus one; a decoding HiSparse request keeps its tail pages and its hot buffer (it can release
        every other page, shared ones together with their other holders)."""
        c = self.cache
        held: set[int] = set()
        extra = 0
        for r in self.active:
            if r.state is RequestState.SWAPPED:
                continue
            rp = c.requests[r.slot]
            if self.policy == "hisparse" and r.state is RequestState.RUNNING:
                tail = [d for d in rp.device[-TAIL_PAGES:] if d != INVALID]
                held.update(tail)
                # what it needs at its longest: all its pages, or tail + hot buffer once it has one
                least = (TAIL_PAGES + c.hot_pages_per_request if rp.hot else
                         c.min_device_pages(max(pages(r.max_kv_len), rp.num_pages)))
                extra += max(least - len(tail), 0)
            else:
                held.update(d for d in rp.device if d != INVALID)
                extra += 1 + len(rp.host_only_pages())
        return len(held) + extra, held

    def can_admit(self, r: Request) -> bool:
        return self._admission(r) is not None

    def _admission(self, r: Request) -> str | None:
        """How `r` would be admitted now: "chunked" (its rows written through the store, prompt resident;
        shares its cached prefix when prefix caching is on), "whole" (one forward, nothing shared), or None."""
        c = self.cache
        if len(self.active) >= self.max_running or not c.free_slots():
            return None
        hits = c.match_prefix(r.kv_tokens) if c.prefix_caching else []
        for tier, field in ((Tier.INDEX, "index"), (Tier.HOST, "host")):
            if tier is Tier.HOST and not c.spec.mirror_to_host:
                continue
            rc = c.pool.refcounts(tier)  # hit pages in use cost nothing (whether or not the hits are taken)
            n_max = pages(r.max_kv_len) - sum(1 for x in hits if getattr(x, field) != INVALID
                                           and rc[getattr(x, field)] > 0)
            if self._committed(tier) + n_max > c.pool.capacity(tier):
                return None
        # the prompt's pages and one growth page (slack the HiSparse floor relies on when pages are shared); a
        # request admitted alone needs only the pages of its prompt and first decode row — exactly what
        # `Engine.add_request` checked, so a request that fits alone is never left waiting forever
        n_kv = len(r.kv_tokens)
        if self.active:
            prompt_pages = max(min(pages(n_kv) + 1, pages(r.max_kv_len)), pages(n_kv))
        else:
            prompt_pages = max(pages(n_kv), pages(min(n_kv + 1 + r.lookahead, r.max_kv_len)))
        hisparse = self.policy == "hisparse"
        # one prompt resident at a time while written through the store keeps the device floor predictable
        chunking = any(x.state is RequestState.PREFILLING and x.slot in c.resident_only for x in self.active)
        if r.imported is None and (self.prefill == "chunked" or hits):  # an import's rows arrive whole
            rc = c.pool.refcounts(Tier.DEVICE)
            if hisparse:  # a hit page the floor holds already costs nothing more
                floor, held = self._device_floor()
                new = prompt_pages - sum(1 for x in hits if x.device in held)
                fits = floor + new <= c.spec.device_pages
            else:  # a hit page in use costs nothing; a cached one is revived out of the free pages
                new = prompt_pages - sum(1 for x in hits if x.device != INVALID and rc[x.device] > 0)
                fits = c.pool.num_free(Tier.DEVICE) >= new
            if fits:  # (a prefix hit waits for the prompt being written: its suffix is short to write)
                return None if chunking else "chunked"
            if self.prefill == "chunked":
                return None
        fits = (self._device_floor()[0] + c.min_device_pages(prompt_pages) <= c.spec.device_pages if hisparse
                else c.pool.num_free(Tier.DEVICE) >= prompt_pages)
        return "whole" if fits else None

    # ----- one step ------------------------------------------------------------------------------
    def schedule(self, step: int) -> StepPlan:
        plan = StepPlan([], [], [], [], [])
        c = self.cache
        # 1. swapped requests come back first (offload), when their whole KV fits again
        for r in [x for x in self.active if x.state is RequestState.SWAPPED]:
            growth = 1 if pages(r.max_kv_len) > c.requests[r.slot].num_pages else 0
            if c.pool.num_free(Tier.DEVICE) >= c.resident_pages_needed(r.slot) + growth:
                c.swap_in(r.slot)
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
        # 3. admit waiting requests
        while self.waiting and (mode := self._admission(self.waiting[0])):
            r = self.waiting.popleft()
            if mode == "whole":
                # the whole prompt's pages; under HiSparse older ones may start on the host
                r.slot = c.admit(len(r.kv_tokens), resident=self.policy != "hisparse")
                r.state, r.computed = RequestState.PREFILLING, 0
                self.active.append(r)
                plan.whole.append(r)
                continue
            r.slot = c.admit(0, tokens=r.kv_tokens)  # shares the cached prefix (resident) if there is one
            c.keep_resident(r.slot)
            r.state, r.computed = RequestState.PREFILLING, c.cached_tokens[r.slot]
            r.cached_tokens += r.computed
            plan.cached_tokens += r.computed
            self.active.append(r)
        # 4. prompt chunks
        budget = self.prefill_chunk
        for r in self.active:
            if r.state is not RequestState.PREFILLING or r in plan.whole or budget <= 0:
                continue
            todo = len(r.kv_tokens) - r.computed
            n = min(todo, budget)
            try:
                c.reserve(r.slot, r.computed + n)
            except OutOfPages:
                continue
            plan.prefill.append((r, r.computed, n))
            budget -= n
        return plan

    def _make_writable(self, r: Request, need: int, plan: StepPlan) -> bool:
        """Reserve the tail page of position need-1 for `r`, applying the policy when the device is full.
        Returns False when `r` itself was preempted or swapped out."""
        c = self.cache
        while True:
            if self.policy == "hisparse":
                c.reserve(r.slot, need)  # evicts cold pages (others' first) as needed
                return True
            if c.can_reserve(r.slot, need):
                c.reserve(r.slot, need)
                return True
            victim = self._newest_running(exclude_prefilling=True)
            if victim is None:
                raise OutOfPages(Tier.DEVICE, 1, c.pool.num_free(Tier.DEVICE), c.spec.device_pages)
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
        self.cache.release(r.slot)
        self.active.remove(r)
        if r in plan.decode:
            plan.decode.remove(r)
        r.slot, r.computed, r.state = -1, 0, RequestState.WAITING
        r.preemptions += 1
        self.waiting.appendleft(r)
        plan.preempted.append(r)

    def _swap_out(self, r: Request, plan: StepPlan) -> None:
        self.cache.swap_out(r.slot)
        r.state = RequestState.SWAPPED
        r.swaps += 1
        if r in plan.decode:
            plan.decode.remove(r)
        plan.swapped_out.append(r)

    def finish(self, r: Request, state: RequestState) -> None:
        if r in self.active:
            self.active.remove(r)
            self.cache.release(r.slot)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.slot, r.state = -1, state
