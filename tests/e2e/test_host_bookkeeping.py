"""`PageManager` is host-only bookkeeping: it runs in an interpreter where jax cannot be imported, its decisions
reach the device only as ordered `updates`, and those updates, applied, give the tables the manager describes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import hisparse_jax as hj
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.audit import check_table_copies
from hisparse_jax.kv.manager import PageManager, least_recently_selected
from hisparse_jax.kv.pool import Tier
from hisparse_jax.kv.updates import ClearStamps, EvictPages, LoadPages, SetTables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKLOAD = textwrap.dedent("""
    import hisparse_jax as hj
    from hisparse_jax.kv.audit import check_manager
    from hisparse_jax.kv.manager import PageManager, least_recently_selected
    cfg = hj.get_preset("tiny-glm")
    tc = PageManager(cfg, hj.CacheConfig(kv_dtype="float32", device_pages=34, host_pages=96, max_seqs=4,
                                         max_seq_len=1536), victim_order=least_recently_selected)
    slots = [tc.admit(300) for _ in range(2)]
    for step in range(700):  # decode growth under pressure: pages are released, hot buffers lent
        if step == 100:
            slots.append(tc.admit(300))
        for s in slots:
            tc.reserve(s, tc.lengths[s] + 1)
        tc.advance(slots)
    tc.swap_out(slots[0]); tc.release(slots[1]); tc.swap_in(slots[0])
    check_manager(tc)
""")


def test_bookkeeping_runs_without_jax():
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        sys.meta_path.insert(0, Block())
    """) + WORKLOAD + textwrap.dedent("""
        kinds = sorted({type(u).__name__ for u in tc.take_updates()})
        print(tc.evicted_pages, kinds, sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax")))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    evicted, kinds, loaded = out.stdout.strip().split(" ", 1)[0], *out.stdout.strip().split(" ", 1)[1].rsplit(" [", 1)
    assert int(evicted) > 0  # the workload did release pages under pressure
    assert "EvictPages" in kinds and "LoadPages" in kinds and "SetTables" in kinds and "ClearStamps" in kinds
    assert loaded == "]"  # no jax / flax module was imported


def test_updates_applied_give_the_tables_the_manager_describes():
    ns: dict = {}
    exec(WORKLOAD.replace("check_manager(tc)", ""), ns)
    tc: PageManager = ns["tc"]
    updates = list(tc.updates)
    assert {type(u) for u in updates} == {SetTables, ClearStamps, EvictPages, LoadPages}
    for u in updates:  # plain host data: NumPy rows and Python ints, no device arrays
        for v in u:
            assert isinstance(v, (int, np.ndarray, type(None))), type(v)
    store = kv_device.new_store(tc)  # applies every update in order
    assert not tc.updates
    # no decode step ran, so the store's lengths are those the last table update carried; every table must match
    lengths = np.zeros(tc.spec.max_seqs, np.int32)
    lengths[list(tc.lengths)] = list(tc.lengths.values())
    tables = jax.device_get((store.block_table, store.host_table, store.index_table, store.hot_pages))
    check_table_copies(tc, *tables, lengths)


def test_coldness_is_a_plug_in_over_a_read_only_view():
    """Eviction takes a request's pages in the order its coldness returns, given the evictable pages and a read-only
    view of the request's stamps: newest-first evicts the newest sealed pages, and a coldness cannot write."""
    views = []

    def newest_first(pages, stamps):
        views.append(stamps.flags.writeable)
        return pages[::-1]

    def writes(pages, stamps):
        stamps[0] = 7
        return pages

    cache = hj.CacheConfig(kv_dtype="float32", device_pages=20, host_pages=32, max_seqs=2, max_seq_len=1024)
    assert PageManager(hj.get_preset("tiny-glm"), cache).budget_spec.hot_pages == 8
    for coldness, evicted in ((newest_first, [5, 6, 7, 8, 9, 10, 11, 12, 13]),
                              (least_recently_selected, [0, 1, 2, 3, 4, 5, 6, 7, 8])):  # no page selected yet: oldest
        tc = PageManager(hj.get_preset("tiny-glm"), cache, victim_order=coldness)
        s = tc.admit(64 * 16)  # 16 resident pages, 0..13 sealed; its 8 hot pages are paid for by the first 8 evicted
        tc.evict_until(tc.pool.num_free(Tier.DEVICE) + 1)
        assert tc.requests[s].host_only_pages() == evicted
    assert views and not any(views)
    tc = PageManager(hj.get_preset("tiny-glm"), cache, victim_order=writes)
    tc.admit(64 * 16)
    with pytest.raises(ValueError, match="read-only"):
        tc.evict_until(tc.pool.num_free(Tier.DEVICE) + 1)


def test_unapplied_updates_are_refused_where_they_would_be_lost(tmp_path):
    from hisparse_jax.kv.persist import save_tiered

    tc = PageManager(hj.get_preset("tiny-glm"), hj.CacheConfig(kv_dtype="float32", device_pages=16, max_seqs=2,
                                                                max_seq_len=512))
    store = kv_device.new_store(tc)
    tc.admit(100)
    try:
        save_tiered(tc, store, tmp_path / "c")
    except ValueError as e:
        assert "apply_updates" in str(e)
    else:
        raise AssertionError("save_tiered accepted a store missing the manager's last decisions")
    try:
        kv_device.check_tables(store, tc)
    except RuntimeError as e:
        assert "apply_updates" in str(e)
    else:
        raise AssertionError("check_tables compared tables with updates still pending")


def test_the_store_knows_no_model():
    """The model drives the store, never the other way round: importing every kv module loads no model or
    engine module (the model-driving steps live in `engine.runner`; old names in `kv.tiered` resolve lazily)."""
    code = textwrap.dedent("""
        import sys
        import hisparse_jax.kv.device, hisparse_jax.kv.dense, hisparse_jax.kv.manager, hisparse_jax.kv.persist
        import hisparse_jax.kv.codec, hisparse_jax.kv.resolve
        import hisparse_jax.kv.scoring, hisparse_jax.kv.tiered, hisparse_jax.kv.writes
        print(sorted(m for m in sys.modules if m.startswith(("hisparse_jax.model", "hisparse_jax.engine"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
