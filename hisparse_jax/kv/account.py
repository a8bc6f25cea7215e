"""The memory account of a tiered store, before any of it exists: every array's shape, value dtype and memory
(`store_layout`), their bytes with the host bookkeeping's and the step's temporaries (`store_costs`), and the
refusal of a store that cannot fit (`check_store_memory`). Pure arithmetic on a `StoreSpec` (NumPy dtypes, no
jax): `generate` and the engines check it before the host bookkeeping (`kv.manager.TieredCache`, which checks its
own part) or the store exist, and `kv.state.init_store` builds exactly this layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hisparse_jax.kv.pool import POOL_BYTES_PER_PAGE
from hisparse_jax.kv.spec import FP8_BLOCK, MXFP4_BLOCK, SUMMARY_DTYPE, StoreSpec
from hisparse_jax.memory import Cost, check_account
from hisparse_jax.units import PAGE_SIZE

# Temporaries of the step's hot-buffer resolve per (step row x hot slot): each row resolves against its request's
# whole hot buffer (`pallas_kernels/sparse_gather/reference.py`: the slots' tags and stamps gathered per row,
# sorted twice, ranked), so the step's temporaries grow as step rows x hot_rows. XLA's memory analysis (CPU) of
# the resolver alone gives 41.1 bytes per row and slot (B 16-256, hot_rows 4096-65536); of the compiled engine
# step 39-63 (demo-glm, two indexer groups, B 8-32, hot_rows 4096-4194304) and 40.1 (a one-layer model,
# `tests/test_red_team.py::test_step_temporaries_formula`, which keeps the bound honest).
RESOLVE_BYTES_PER_ROW_SLOT = 64

# the CacheConfig sizes each array's size follows (named when an account does not fit)
_SIZED_BY = {"latent": ("device_pages",), "rope": ("device_pages",), "latent_scale": ("device_pages",),
             "index_k": ("index_pages",), "index_scale": ("index_pages",), "index_ema": ("index_pages",),
             "index_lo": ("index_pages",), "index_hi": ("index_pages",),
             "h_latent": ("host_pages",), "h_rope": ("host_pages",), "h_latent_scale": ("host_pages",),
             "hot_token": ("hot_rows", "max_seqs"), "hot_stamp": ("hot_rows", "max_seqs"),
             "hot_pages": ("hot_rows", "max_seqs")}


def store_layout(spec: StoreSpec) -> dict[str, tuple[tuple[int, ...], np.dtype, str]]:
    """name -> (shape, value dtype, "device" | "host") of every array a store of geometry `spec` has (the
    `kv.state.KVStore` fields it uses, in field order): host pools (and with index_tier="host" the indexer keys)
    in pinned-host memory, which holds their values' bits (`kv.state.host_dtype`, the same width)."""
    L, LI, P, PI = spec.num_layers, spec.num_index_layers, spec.device_pages, spec.index_pages
    # a host tier of no pages (preempt never offloads) still has one physical page, never lent: the step's miss
    # path gathers from the host pools whatever the policy, and a gather from an empty axis cannot be traced
    PH = max(1, spec.host_pages)
    C, R, dI, Rq, MP = spec.latent_dim, spec.rope_dim, spec.index_dim, spec.max_seqs, spec.max_pages
    G, HR = len(spec.groups), spec.hot_rows
    vdt = spec.value_dtype
    kdt = np.dtype(ml_dtypes.float8_e4m3fn) if spec.fp8 else vdt
    kvals, svals = spec.index_dtypes  # the indexer keys' layout (`StoreSpec.index_dtype`)
    keys = "host" if spec.index_tier == "host" else "device"
    key_shape, scale_shape = {
        "fp8": ((LI, PI, PAGE_SIZE, dI), (LI, PI, PAGE_SIZE)),
        "int4": ((LI, PI, PAGE_SIZE, dI // 2), (LI, PI, PAGE_SIZE, dI // MXFP4_BLOCK)),
    }.get(spec.index_dtype, ((LI, PI, PAGE_SIZE, dI), None))
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    out = {"latent": ((L, P, PAGE_SIZE, C), kdt, "device"), "rope": ((L, P, PAGE_SIZE, R), vdt, "device"),
           "index_k": (key_shape, kvals, keys), "h_latent": ((L, PH, PAGE_SIZE, C), kdt, "host"),
           "h_rope": ((L, PH, PAGE_SIZE, R), vdt, "host"), "block_table": ((Rq, MP), i32, "device"),
           "host_table": ((Rq, MP), i32, "device"), "index_table": ((Rq, MP), i32, "device"),
           "seq_lens": ((Rq,), i32, "device"), "hot_pages": ((Rq, spec.hot_pages), i32, "device"),
           "hot_token": ((Rq, G, HR), i32, "device"), "hot_stamp": ((Rq, G, HR), i32, "device"),
           "clock": ((), i32, "device"), "page_stamp": ((Rq, MP), i32, "device")}
    if spec.fp8:
        out["latent_scale"] = ((L, P, PAGE_SIZE, C // FP8_BLOCK), f32, "device")
    if svals is not None:
        out["index_scale"] = (scale_shape, svals, keys)
    if spec.fp8:
        out["h_latent_scale"] = ((L, PH, PAGE_SIZE, C // FP8_BLOCK), f32, "host")
    if spec.hot_policy == "score_ema":
        out["index_ema"] = ((LI, PI, PAGE_SIZE), f32, "device")
    if spec.index_tier == "host":
        out["index_lo"] = ((LI, PI, dI), SUMMARY_DTYPE, "device")
        out["index_hi"] = ((LI, PI, dI), SUMMARY_DTYPE, "device")
    return out


def _sizes(spec: StoreSpec, names: tuple[str, ...]) -> str:
    values = {"max_seqs": spec.max_seqs, "max_seq_len": spec.max_pages * PAGE_SIZE}
    return " x ".join(f"{n}={values.get(n, getattr(spec, n, None)):,}" for n in names)


def store_costs(spec: StoreSpec, *, step_rows: int = 0) -> list[Cost]:
    """The memory account of a store of geometry `spec`: its arrays (`store_layout`), the host bookkeeping
    `kv.manager.TieredCache` keeps (`PagePool`'s per-page counts, the per-page recency stamps), and with
    `step_rows` > 0 the temporaries a step of that many batch rows makes in resolving them against the hot
    buffers (`RESOLVE_BYTES_PER_ROW_SLOT`)."""
    out = [Cost(f"the store's {name}", int(np.prod(shape, dtype=object)) * np.dtype(dt).itemsize, where,
                _sizes(spec, _SIZED_BY.get(name, ("max_seqs", "max_seq_len"))))
           for name, (shape, dt, where) in store_layout(spec).items()]
    out += bookkeeping_costs(spec)
    if step_rows:
        out.append(Cost("the step's hot-buffer resolve temporaries", RESOLVE_BYTES_PER_ROW_SLOT * step_rows *
                        spec.hot_rows, "device", f"{_sizes(spec, ('hot_rows',))} x {step_rows} step rows"))
    return out


def bookkeeping_costs(spec: StoreSpec) -> list[Cost]:
    """What `kv.manager.TieredCache` allocates in host memory for `spec`: `PagePool`'s per-page counts and the
    per-page recency stamps."""
    pages = spec.device_pages + spec.index_pages + spec.host_pages
    return [Cost("the page pools' bookkeeping", POOL_BYTES_PER_PAGE * pages, "host",
                 _sizes(spec, ("device_pages", "index_pages", "host_pages")).replace(" x ", " + ")),
            Cost("the per-page recency stamps", 4 * spec.max_seqs * spec.max_pages, "host",
                 _sizes(spec, ("max_seqs", "max_seq_len")))]


def check_store_memory(spec: StoreSpec, *, step_rows: int = 0, ranks: int = 1, also: tuple[Cost, ...] = (),
                       device=None) -> None:
    """Refuse (ValueError), before any of it exists, a store whose account (`store_costs`, plus `also`: e.g. the
    model's copies on a mesh) does not fit: per device against the device's memory, `ranks` stores' host parts
    against this machine's RAM (`memory.check_account`), naming the bytes, the limit, the largest part and the
    CacheConfig sizes it follows."""
    check_account("the KV store", store_costs(spec, step_rows=step_rows) + list(also), device=device, ranks=ranks)
