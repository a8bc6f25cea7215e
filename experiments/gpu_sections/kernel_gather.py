"""gpu_check's `kernel_gather` section: the fused HiSparse resolver (sparse_gather) against its reference on a
case with resident pages, hot-buffer hits and misses, timed with the hot state carried from call to call."""

from __future__ import annotations

import jax
import numpy as np

from experiments.gpu_sections.checks import KERNEL_CONVENTION, run_variants, time_pair, traffic_fields
from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.timing import block
from hisparse_jax.kernel_cases import gather_case


GATHER_FIELDS = ("page", "row", "valid", "resident", "miss", "src_page", "src_row", "hot_token", "hot_stamp")


def kernel_gather(ctx, seed: int) -> dict:
    from functools import partial

    from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference

    sz = ctx.sz
    B, K, HR, S = sz["gather_B"], sz["gather_K"], sz["gather_hot_rows"], sz["gather_ctx"]
    args = block(gather_case(seed, B=B, K=K, hot_rows=HR, context=S))
    kern = jax.jit(partial(sparse_gather, hot_rows=HR, interpret=ctx.interpret))
    ref = jax.jit(partial(sparse_gather_reference, hot_rows=HR))
    got = [np.asarray(x) for x in kern(*args)]
    want = [np.asarray(x) for x in ref(*args)]
    fields = {name: bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
              for name, a, b in zip(GATHER_FIELDS, got, want)}
    valid, resident, miss = want[2], want[3], want[4]
    counts = {"slots": int(valid.size), "valid": int(valid.sum()), "resident": int(resident.sum()),
              "hits": int((valid & ~resident & ~miss).sum()), "misses": int(miss.sum())}
    MP, NH = S // 64, -(-HR // 64)
    # bytes one call must touch: top-k, the B rows of both tables, of hot_pages and of the hot state (read and
    # written), and the plan (4 int32 + 3 bool per slot)
    nbytes = B * K * 4 + B * 4 + 2 * B * MP * 4 + B * NH * 4 + 2 * 2 * B * HR * 4 + B * K * (4 * 4 + 3)
    rec = {"kernel": "sparse_gather", "variant": "mixed", "B": B, "K": K, "hot_rows": HR, "context": S,
           "interpret": ctx.interpret, "counts": counts,
           "correct": {"fields_identical": fields, "plan_identical": all(fields[f] for f in GATHER_FIELDS[:7]),
                       "hot_state_identical": fields["hot_token"] and fields["hot_stamp"]},
           "passed": all(fields.values()) and counts["hits"] > 0 and counts["misses"] > 0,
           "bytes_note": "bytes_read = top-k + the B rows of block/host tables and hot_pages + hot state read and "
                         "written + the plan written (the resolver is compare-bound, not bandwidth-bound)"}
    ctx.checkpoint(rec)
    # chained calls carry the hot state (hot_token, hot_stamp) from one call to the next, clock + 1 per call
    call = lambda f: lambda v, c: f(*c, *v)  # noqa: E731
    step = lambda v, o: (o[7], o[8], v[2] + 1)  # noqa: E731
    rec.update(time_pair(ctx, call(kern), call(ref), tuple(args[5:]), tuple(args[:5]), step, nbytes))
    rec["timing_note"] = "later calls see the hot state the previous call left (more hits than the first)"
    rec.update(traffic_fields(ctx, rec, lambda: _gather_loop_traffic(ref, args, want, HR, S // 64, sz["loop_n"])))
    return rec


def _gather_loop_traffic(ref, args, want, HR: int, MP: int, n: int):
    """The traffic model of one call of the timing loop: its first call (the case's state: random stamps, maybe
    radix passes to select the victims) and n - 1 calls on the state the previous call left, averaged per call."""
    from pallas_kernels import traffic

    B, K = args[0].shape
    first = traffic.gather_plan_counts(*args[:3], args[4], args[5], args[6], args[7], *want[2:5], hot_rows=HR)
    nxt = [np.asarray(x) for x in ref(*args[:5], want[7], want[8], args[7] + 1)]
    later = traffic.gather_plan_counts(*args[:3], args[4], want[7], want[8], args[7] + 1, *nxt[2:5], hot_rows=HR)
    t1 = traffic.sparse_gather_traffic(B, K, HR, MP, **first)
    t2 = traffic.sparse_gather_traffic(B, K, HR, MP, **later)
    mean = lambda a, b: (a + (n - 1) * b) // max(n, 1)  # noqa: E731
    return traffic.Traffic(mean(t1.read_bytes, t2.read_bytes), mean(t1.write_bytes, t2.write_bytes),
                           mean(t1.ideal_bytes, t2.ideal_bytes), t2.launches,
                           f"mean of 1 first call ({first}) and {n - 1} later calls ({later}); later: {t2.notes}",
                           t2.passes, t2.reference_bytes)


def section_kernel_gather(ctx: Ctx) -> dict:
    return dict(run_variants(ctx, [("sparse_gather mixed", lambda c: kernel_gather(c, 100))]),
                convention=KERNEL_CONVENTION)
