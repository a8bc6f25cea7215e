"""The memory account of a tiered store, before any of it exists: every array's shape, value dtype and memory
(`store_layout`), their bytes with the host bookkeeping's and the step's temporaries (`store_costs`), and the
refusal of a store that cannot fit (`check_store_memory`). Arithmetic on a `StoreSpec` (NumPy dtypes; jax only
asked which backend runs a step): `generate` and the engines check it before the host bookkeeping (`kv.manager.PageManager`, which checks its
own part) or the store exist, and `kv.state.init_store` builds exactly this layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hisparse_jax.formats import RVQ_SIZE
from hisparse_jax.kv.pool import POOL_BYTES_PER_PAGE
from hisparse_jax.kv.spec import FP8_BLOCK, MXFP4_BLOCK, SUMMARY_DTYPE, StoreSpec
from hisparse_jax.memory import Cost, check_account
from hisparse_jax.units import PAGE_SIZE

# Temporaries of the step's hot-buffer resolve per (step row x hot slot): each row resolves against its request's
# whole hot buffer (`pallas_kernels/sparse_gather/reference.py`: the slots' tags and stamps gathered per row,
# sorted twice, ranked), so the step's temporaries grow as step rows x hot_rows. XLA's memory analysis (CPU) of
# the resolver alone gives 41.1 bytes per row and slot (B 16-256, hot_rows 4096-65536); of the compiled engine
# step 39-63 (demo-glm, two indexer groups, B 8-32, hot_rows 4096-4194304) and 40.1 (a one-layer model,
# `tests/e2e/test_red_team.py::test_step_temporaries_formula`, which keeps the bound honest).
RESOLVE_BYTES_PER_ROW_SLOT = 64

# Temporaries of the step's indexer per (step row x position of its span): the reference indexer gathers each row's
# keys over the span (`kv.tiered.index_span`, at most max_seq_len positions) as float32 and scores them per index
# head, [rows, span, dI] and [rows, span, heads] float32, then takes the top-k of the scores (values and positions).
# XLA's memory analysis (CPU) of demo-glm's engine step, 32 rows at a span of 1024 against 4096 positions, per row
# and position: 512 bytes at dI 128 with 4 index heads (the formula: 560), 255 at dI 64 (304), 597 with 16 heads
# (656), 512 with a latent of 256 instead of 512 (560): keys and heads, not the latent, set it.
INDEX_BYTES_PER_HEAD = 8
INDEX_BYTES_PER_DIM = 4
INDEX_BYTES_PER_POSITION = 16


def index_bytes_per_row_position(index_dim: int, index_heads: int) -> int:
    """Bytes of the step's indexer temporaries per batch row and position of its span (see above)."""
    return INDEX_BYTES_PER_DIM * index_dim + INDEX_BYTES_PER_HEAD * index_heads + INDEX_BYTES_PER_POSITION


# the CacheConfig sizes each array's size follows (named when an account does not fit)
_SIZED_BY = {"latent": ("device_pages",), "rope": ("device_pages",), "latent_scale": ("device_pages",),
             "index_k": ("index_pages",), "index_scale": ("index_pages",), "index_ema": ("index_pages",),
             "index_lo": ("index_pages",), "index_hi": ("index_pages",), "index_codes": ("index_pages",),
             "index_radius": ("index_pages",), "index_codebooks": (), "index_rope_freq": (),
             "h_latent": ("host_pages",), "h_rope": ("host_pages",), "h_latent_scale": ("host_pages",),
             "hot_token": ("hot_rows", "max_seqs"), "hot_stamp": ("hot_rows", "max_seqs"),
             "hot_pages": ("hot_rows", "max_seqs")}


def store_layout(spec: StoreSpec) -> dict[str, tuple[tuple[int, ...], np.dtype, str]]:
    """name -> (shape, value dtype, "device" | "host") of every array a store of geometry `spec` has (the
    `kv.state.KVStore` fields it uses, in field order): host pools (and with index_tier="host" the indexer keys)
    in pinned-host memory, which holds their values' bits (`kv.state.host_dtype`, the same width)."""
    L, LI, P, PI = spec.num_layers, spec.num_indexer_layers, spec.device_pages, spec.index_pages
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
    if spec.index_tier == "host" and spec.index_summary == "box":
        out["index_lo"] = ((LI, PI, dI), SUMMARY_DTYPE, "device")
        out["index_hi"] = ((LI, PI, dI), SUMMARY_DTYPE, "device")
    if spec.index_tier == "host" and spec.index_summary == "rvq":
        m = spec.index_stages
        out["index_codes"] = ((LI, PI, PAGE_SIZE, m), np.dtype(np.uint8), "device")
        out["index_radius"] = ((LI, PI, PAGE_SIZE), np.dtype(ml_dtypes.float8_e4m3fn), "device")
        out["index_codebooks"] = ((LI, m, RVQ_SIZE, dI), np.dtype(ml_dtypes.bfloat16), "device")
        out["index_rope_freq"] = ((R // 2,), f32, "device")
    return out


def index_codebook_bytes(spec: StoreSpec) -> int:
    """index_summary="rvq": the device bytes of its codebooks and rope frequencies (`store_layout`'s
    `index_codebooks`, `index_rope_freq`), a fixed cost whatever the pools' sizes; 0 otherwise."""
    layout = store_layout(spec)
    return sum(_nbytes(*layout[n][:2]) for n in ("index_codebooks", "index_rope_freq") if n in layout)


def _sizes(spec: StoreSpec, names: tuple[str, ...]) -> str:
    values = {"max_seqs": spec.max_seqs, "max_seq_len": spec.max_pages * PAGE_SIZE}
    return " x ".join(f"{n}={values.get(n, getattr(spec, n, None)):,}" for n in names)


def store_costs(spec: StoreSpec, *, step_rows: int = 0, index_heads: int = 0, cpu: bool = False) -> list[Cost]:
    """The memory account of a store of geometry `spec`: its arrays (`store_layout`), the host bookkeeping
    `kv.manager.PageManager` keeps (`PagePool`'s per-page counts, the per-page recency stamps), and with
    `step_rows` > 0 the temporaries of a step of that many batch rows: the hot-buffer resolve's
    (`RESOLVE_BYTES_PER_ROW_SLOT`), the indexer's over the longest span (`index_bytes_per_row_position`, with the
    model's `index_heads`), and on a CPU (`cpu`) the copy of the store XLA:CPU makes around the fetch's
    `lax.switch` (its memory analysis of the step: temporaries of the store's size at any batch; the sm_90 build
    makes none, `tests/e2e/test_gpu_build_fetch.py`)."""
    layout = store_layout(spec)
    out = [Cost(f"the store's {name}", _nbytes(shape, dt), where, _sizes(spec, _SIZED_BY.get(name, ("max_seqs",
                                                                                                  "max_seq_len"))))
           for name, (shape, dt, where) in layout.items()]
    out += bookkeeping_costs(spec)
    if step_rows:
        if index_heads < 1:
            raise ValueError("the step's account needs index_heads >= 1 (the model's index_n_heads)")
        rows = f"{step_rows:,} step rows"
        out.append(Cost("the step's hot-buffer resolve temporaries", RESOLVE_BYTES_PER_ROW_SLOT * step_rows *
                        spec.hot_rows, "device", f"{_sizes(spec, ('hot_rows',))} x {rows}"))
        out.append(Cost("the step's indexer temporaries", index_bytes_per_row_position(spec.index_dim, index_heads)
                        * step_rows * spec.max_pages * PAGE_SIZE, "device",
                        f"{_sizes(spec, ('max_seq_len',))} x {rows}"))
        if cpu:
            sizes = {name: _nbytes(shape, dt) for name, (shape, dt, _) in layout.items()}
            largest = max(sizes, key=sizes.get)  # the copy is sized by what sizes the store's largest array
            out.append(Cost("XLA:CPU's copy of the store around the step's fetch", sum(sizes.values()), "device",
                            _sizes(spec, _SIZED_BY.get(largest, ("max_seqs", "max_seq_len")))))
    return out


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    return int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize


def bookkeeping_costs(spec: StoreSpec) -> list[Cost]:
    """What `kv.manager.PageManager` allocates in host memory for `spec`: `PagePool`'s per-page counts and the
    per-page recency stamps."""
    pages = spec.device_pages + spec.index_pages + spec.host_pages
    return [Cost("the page pools' bookkeeping", POOL_BYTES_PER_PAGE * pages, "host",
                 _sizes(spec, ("device_pages", "index_pages", "host_pages")).replace(" x ", " + ")),
            Cost("the per-page recency stamps", 4 * spec.max_seqs * spec.max_pages, "host",
                 _sizes(spec, ("max_seqs", "max_seq_len")))]


def check_store_memory(spec: StoreSpec, *, step_rows: int = 0, index_heads: int = 0, ranks: int = 1,
                       also: tuple[Cost, ...] = (), device=None) -> None:
    """Refuse (ValueError), before any of it exists, a store whose account (`store_costs`, with the temporaries of
    a step of `step_rows` rows, plus `also`: e.g. the model's copies on a mesh) does not fit: per device against the
    device's memory, `ranks` stores' host parts against this machine's RAM (`memory.check_account`), naming the
    bytes, the limit, the largest part and the CacheConfig sizes it follows."""
    cpu = False
    if step_rows:
        import jax

        cpu = (device if device is not None else jax.devices()[0]).platform == "cpu"
    check_account("the KV store", store_costs(spec, step_rows=step_rows, index_heads=index_heads, cpu=cpu)
                  + list(also), device=device, ranks=ranks)
