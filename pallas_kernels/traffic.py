"""Memory-traffic model of the three Pallas kernels: global-memory bytes read and written per call, from each
kernel's grid, BlockSpecs, explicit loads / stores and passes, next to the ideal (each input byte read once,
each output byte written once). Pure Python: no jax work at import or call.

    t = sparse_mla_decode_traffic(64, 128, 512, 64, 2048, kv_dtype="fp8", query_dtype="bfloat16")
    t.read_bytes, t.write_bytes, t.ideal_bytes, t.ratio, t.launches, t.notes, t.passes

What is counted. The kernels use the Triton backend, where a BlockSpec only offsets a pointer: a program
moves exactly the elements its body loads or stores. Whole-array specs (the pools, the tables) cost nothing
by themselves; `ref[...]` on a blocked ref moves the block; `ref[i]`, `ref[pl.ds(..)]` and `plgpu.load` /
`plgpu.store` with vector indices move their elements, a masked one only its active lanes. Every load the
kernel source issues is counted, once per program that issues it (a value re-read by many programs, such as
the indexer's q block, counts every time). That is the traffic the kernel asks of the memory system:

* an upper bound on HBM bytes where L2 (50 MB on an H100/H200) absorbs re-reads of a small working set
  (the indexer's int32 key buffer is 2 MB for 4 rows at 128K; the per-program q / candidate re-reads);
* a lower bound where a gather moves whole 32-byte sectors for fewer useful bytes (the resolver's int32 table
  gathers, the decode kernel's 4-byte fp8 scales: its four scales per row share one sector);
* with the compiler's CSE of repeated loads of one address inside a program ignored.

Each function also adds the XLA glue its wrapper runs around the `pallas_call`s (padding, the radix
digit sums, the split-K merge, ...), as passes of kind "xla", estimated as one read of each operand and one
write of each result per fusion; they are marked in `passes` and are small except the decode's split-K
partials. `launches` counts `pallas_call` launches only.

`tests/e2e/test_traffic.py` checks every "pallas" pass exactly: it runs each wrapper with `pl.pallas_call`
replaced by a grid loop that executes the kernel body in Python on recording refs (every element a program
loads or stores is counted, masked lanes excluded) and compares the bytes per pass with these formulas.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pallas_kernels.common import FP8_BLOCK, PAGE
from pallas_kernels.indexer_topk.kernel import (COUNT_SUB, MAX_CHUNK, MIN_DOT, PAGES_PER_BLOCK, RADIX_BITS,
                                                RANK_COLS, RANK_ROWS)
from pallas_kernels.sparse_gather.kernel import SELECT_BITS, SELECT_BUCKETS, tiles as gather_tiles

__all__ = ["Pass", "Traffic", "dtype_bytes", "gather_plan_counts", "index_key_bytes", "indexer_topk_mosaic_traffic",
           "indexer_topk_traffic",
           "production_shapes", "roofline", "selection_passes", "sparse_gather_traffic",
           "sparse_mla_decode_compact_traffic", "sparse_mla_decode_mosaic_traffic",
           "sparse_mla_decode_traffic"]

I32 = 4
F32 = 4

_DTYPE_BYTES = {"fp8": 1, "float8_e4m3fn": 1, "e4m3": 1, "bf16": 2, "bfloat16": 2, "float32": 4, "f32": 4,
                "int32": 4, "bool": 1}


def dtype_bytes(name) -> int:
    """Bytes per element of a dtype name ("fp8" / "float8_e4m3fn", "bf16" / "bfloat16", "float32" / "f32")."""
    key = str(name)
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def index_key_bytes(key_dtype, index_dim: int) -> int:
    """Bytes of one stored indexer key with its scales: "fp8" (e4m3 + one f32 scale), "int4" (MXFP4: dI / 2 code
    bytes + one UE8M0 scale byte per 32 values), "bf16" / "float32" (no scale)."""
    if str(key_dtype) == "int4":
        return index_dim // 2 + index_dim // 32
    kb = dtype_bytes(key_dtype)
    return index_dim * kb + (F32 if kb == 1 else 0)


def _quantized_keys(key_dtype) -> bool:
    """fp8 or MXFP4 (int4) indexer keys: the kernels quantize the query as the keys are."""
    return str(key_dtype) == "int4" or dtype_bytes(key_dtype) == 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Pass:
    """One launch group of a call: a `pallas_call` (kind "pallas", counted exactly) or an XLA glue fusion
    (kind "xla", estimated). `launches` is the number of `pallas_call` launches it stands for."""
    name: str
    read_bytes: int
    write_bytes: int
    launches: int = 1
    kind: str = "pallas"

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one call moves (all passes, glue included), the ideal, Pallas launches, and what dominates."""
    read_bytes: int
    write_bytes: int
    ideal_bytes: int
    launches: int
    notes: str
    passes: tuple = ()  # Pass records, in execution order (same name = summed)
    reference_bytes: int = 0  # the v2 target's yardstick: keys read once / selected rows read once / 0
    # the decodes: times each selected fp8 row is decoded for the matrix units (0 with bf16 / f32 pools); None for
    # the kernels that decode no KV rows
    conversions: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def ratio(self) -> float:
        """total / ideal (>= 1)."""
        return self.total_bytes / self.ideal_bytes

    @property
    def pallas_bytes(self) -> int:
        return sum(p.total_bytes for p in self.passes if p.kind == "pallas")

    def time_s(self, bytes_per_s: float) -> float:
        """The call's time if every byte moved at `bytes_per_s` (read + write traffic rate)."""
        return self.total_bytes / bytes_per_s

    def by_pass(self, kind: str | None = None) -> dict:
        """{pass name: (read, write)} summed over passes of one name (optionally of one kind)."""
        out: dict = {}
        for p in self.passes:
            if kind is None or p.kind == kind:
                r, w = out.get(p.name, (0, 0))
                out[p.name] = (r + p.read_bytes, w + p.write_bytes)
        return out

    def to_json(self) -> dict:
        return {"read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "total_bytes": self.total_bytes,
                "ideal_bytes": self.ideal_bytes, "ratio": self.ratio, "launches": self.launches,
                "reference_bytes": self.reference_bytes,
                "total_vs_reference": self.total_bytes / self.reference_bytes if self.reference_bytes else None,
                "conversions_per_row": self.conversions, "notes": self.notes,
                "passes": [{"name": n, "read_bytes": r, "write_bytes": w,
                            "kind": next(p.kind for p in self.passes if p.name == n)}
                           for n, (r, w) in self.by_pass().items()]}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _make(passes: Sequence[Pass], ideal: int, why: str, reference: int = 0, excess: dict | None = None,
          conversions: int | None = None) -> Traffic:
    read = sum(p.read_bytes for p in passes)
    write = sum(p.write_bytes for p in passes)
    total = read + write
    shares = sorted(((r + w, n) for n, (r, w) in Traffic(0, 0, 1, 0, "", tuple(passes)).by_pass().items()),
                    reverse=True)
    top = ", ".join(f"{n} {100 * b / total:.0f}%" for b, n in shares[:3] if b)
    notes = f"{why} Largest passes: {top}."
    if excess:
        parts = sorted(((k, v) for k, v in excess.items() if v), key=lambda kv: -kv[1])
        rest = total - ideal - sum(excess.values())
        notes += (f" Excess over ideal {_mb(total - ideal)}: " + ", ".join(f"{k} {_mb(v)}" for k, v in parts)
                  + f", other {_mb(rest)}.")
    return Traffic(read, write, ideal, sum(p.launches for p in passes if p.kind == "pallas"), notes, tuple(passes),
                   reference, conversions)


# ----- indexer top-k --------------------------------------------------------------------------------------
def indexer_topk_traffic(batch: int, index_heads: int, index_dim: int, seq_len: int, topk: int, *,
                         key_dtype: str = "fp8", query_dtype: str = "bfloat16",
                         seq_lens: Iterable[int] | None = None, max_pages: int | None = None, page: int = PAGE,
                         max_chunk: int = MAX_CHUNK) -> Traffic:
    """`indexer_topk(q [B, I, dI], w, k_pages, block_table [B, MP], seq_lens, topk=K)` (or `_chunked` with
    `max_chunk`). seq_len: the context the block table covers (MP = ceil(seq_len / page) unless max_pages);
    seq_lens: the live length of each row (default: every row seq_len). key_dtype "fp8" (e4m3 keys + one f32
    scale per key), "int4" (MXFP4 codes + UE8M0 scales), "bf16" or "float32"; query_dtype: q as passed.

    Shapes of the wrapper (kernel.py `indexer_topk_chunked`): Ip = max(MIN_DOT, next_pow2(I)) padded heads;
    chunk = max(page, min(max_chunk, next_pow2(MP * page))); ppb = min(PAGES_PER_BLOCK, chunk / page);
    Sp = MP * page rounded up to chunk; NC = Sp / chunk; k_eff = min(K, Sp); 2**RADIX_BITS candidates.
    The kernel-side q is bf16 for fp8 keys (the e4m3 values of the quantized q) and for bf16 q with bf16 keys,
    float32 otherwise.

    1. `_score_kernel`, grid (B, Sp / (ppb * page)): per program `seq_ref[b]` and `layer_ref[0]` (4 B each),
       `q_ref[...]` (Ip * dI; for fp8 keys as 4 parts of dI / 4, the keys being read as uint32 words),
       `w_ref[...]` (Ip * 4); per page whose start < seq_len (the `lax.cond`): `bt_ref[i]` (4 B), `k_ref[pg]`
       (page * dI key bytes) and for fp8 `ks_ref[pg]` (page * 4); writes ppb * page int32 keys (every page).
    2. `_count_kernel`, 32 / RADIX_BITS launches, grid (B, NC): `cand_ref[...]` (2**RADIX_BITS * 4), the
       chunk's keys (chunk * 4, in COUNT_SUB steps); writes 2**RADIX_BITS * 4 counts.
    3. `_tie_count_kernel`, grid (B, NC): `thr_ref[b]`, chunk * 4 keys; writes 2 * 4.
    4. `_compact_kernel`, grid (B, NC): 4 scalars (thr, eq_off, need, sel_off) + chunk * 4 keys; the masked
       scatters write (key, position) of the k_eff selected keys of the row: k_eff * 8 per row.
    5. `_rank_kernel`, grid (B, K / RANK_ROWS): `seq_ref[b]`, its rows' (key, position) (rows * 8) and all K
       candidates (K * 8, RANK_COLS at a time); scatters rows * 4 positions.

    So the int32 key buffer is written once and read 32 / RADIX_BITS + 2 times (10 with RADIX_BITS = 4), and q
    is re-read by each of the Sp / (ppb * page) score programs of a row (Ip * dI * 2 B per 512 positions
    at dI 128 in bf16: 32 B per position for 64 heads, 24% of an fp8 key's 132 B).

    XLA glue (estimated): q rotation / quantization / padding, block-table padding, the per-round digit sums
    over [B, NC, 2**RADIX_BITS] counts, the tie offsets and the candidate-buffer init (2 * B * (K + chunk) * 4).
    Ideal: q, w, seq_lens, the live block-table entries and the live keys (+ fp8 scales) read once, the
    [B, K] int32 result written once. reference_bytes: the live keys (+ scales) read once (the v2 target
    is total <= 2.5 x that at 128K).
    """
    B, I, D, K = batch, index_heads, index_dim, topk
    quantized = _quantized_keys(key_dtype)  # fp8 / MXFP4 keys: q quantized as they are
    key_bytes = index_key_bytes(key_dtype, D)
    qb_in = dtype_bytes(query_dtype)
    qb = 2 if (quantized or (qb_in == 2 and dtype_bytes(key_dtype) == 2)) else 4  # kernel-side q: bf16 or f32
    MP = max_pages if max_pages is not None else _cdiv(seq_len, page)
    S = MP * page
    lens = [min(max(int(n), 0), S) for n in (seq_lens if seq_lens is not None else [seq_len] * B)]
    if len(lens) != B:
        raise ValueError(f"seq_lens has {len(lens)} rows, batch is {B}")
    Ip = max(MIN_DOT, _next_pow2(I))
    chunk = max(page, min(max_chunk, _next_pow2(S)))
    ppb = min(PAGES_PER_BLOCK, chunk // page)
    Sp = _cdiv(S, chunk) * chunk
    NC = Sp // chunk
    NK = 1 << RADIX_BITS
    rounds = 32 // RADIX_BITS
    k_eff = min(K, Sp)
    rows, cols = min(RANK_ROWS, K), min(RANK_COLS, K)
    assert chunk % min(COUNT_SUB, chunk) == 0 and K % cols == 0

    live_pages = sum(_cdiv(n, page) for n in lens)
    key_row = page * key_bytes  # one page of keys (+ its scales)
    score_programs = B * (Sp // (ppb * page))
    passes = [
        Pass("xla: q / w prep", B * I * (D * qb_in + F32), B * Ip * (D * qb + F32), 0, "xla")
        if (quantized or Ip != I or qb != qb_in) else None,
        Pass("xla: block-table pad", B * MP * I32, B * (Sp // page) * I32, 0, "xla") if Sp // page != MP else None,
        Pass("scores", score_programs * (2 * I32 + Ip * D * qb + Ip * F32) + live_pages * (I32 + key_row),
             B * Sp * I32),
        Pass("radix count", rounds * B * NC * (NK * I32 + chunk * I32), rounds * B * NC * NK * I32, rounds),
        Pass("xla: radix digit sums", rounds * (B * NC * NK * I32 + B * I32), rounds * (B * NK * I32 + B * I32),
             0, "xla"),
        Pass("tie counts", B * NC * (I32 + chunk * I32), B * NC * 2 * I32),
        Pass("xla: tie offsets + candidate init", 2 * B * NC * I32, 2 * B * NC * I32 + B * I32
             + 2 * B * (K + chunk) * I32, 0, "xla"),
        Pass("compact", B * NC * (4 * I32 + chunk * I32), B * k_eff * 2 * I32),
        Pass("rank", B * (K // rows) * (I32 + rows * 2 * I32 + K * 2 * I32), B * K * I32),
    ]
    passes = [p for p in passes if p is not None]
    keys_once = sum(n * key_bytes for n in lens)
    ideal = B * I * (D * qb_in + F32) + B * I32 + live_pages * I32 + keys_once + B * K * I32
    why = (f"The live keys are read once ({keys_once} B); the int32 score buffer is written once and read "
           f"{rounds + 2} times (radix rounds + ties + compact), q is re-read by every score program "
           f"({Sp // (ppb * page)} per row) and the rank pass reads all K candidates per {rows} ranked.")
    excess = {"int32 score buffer (1 write + %d reads)" % (rounds + 2): (rounds + 3) * B * Sp * I32,
              "q / w re-read per score program": score_programs * (Ip * D * qb + Ip * F32) - B * I * (D * qb_in + F32),
              "rank (all K candidates per %d ranked)" % rows: B * (K // rows) * (I32 + rows * 2 * I32 + K * 2 * I32)}
    return _make(passes, ideal, why, keys_once, excess)


TOPK_SORT_PASSES = 4  # the estimate of XLA's top-k over [B, Sp] int32 keys: radix passes of 8 bits over (key, index)


def indexer_topk_mosaic_traffic(batch: int, index_heads: int, index_dim: int, seq_len: int, topk: int, *,
                                key_dtype: str = "fp8", query_dtype: str = "bfloat16",
                                seq_lens: Iterable[int] | None = None, max_pages: int | None = None) -> Traffic:
    """`indexer_topk(..., backend="mosaic")`: the Mosaic GPU scores kernel (kernel_mosaic.py) and XLA's top-k.
    Arguments as `indexer_topk_traffic` (pages of 64; key_dtype "fp8", "int4" or "bf16").

    Shapes of the wrapper: Ip = I rounded up to 64 (HEADS); MPp = MP rounded up to PAGES_PER_BLOCK (ppb) pages;
    Sp = MPp * 64; T query parts (3 bf16 parts for float32 q with bf16 keys, else 1), 2 bytes each.

    1. the scores kernel, grid (B, MPp / ppb), one warpgroup: per block the row's seq_len (4 B), its ppb block-table
       entries (one copy, ppb * 4), q (Ip * T * dI * 2) and w (Ip * 4); per page whose start < seq_len one copy of
       its keys (64 * dI key bytes) and for fp8 one of its 64 scales (64 * 4); writes the 64 int32 keys of every
       page (live or not): B * Sp * 4. So the keys are read once and q once per ppb pages (Ip * T * dI * 2 B per
       512 positions: 32 B per position at 64 heads x 128, bf16 q).
    2. XLA's top-k over the [B, Sp] keys (estimated: TOPK_SORT_PASSES radix passes reading and writing (key,
       index) pairs, 8 B per position each way), then the -1 mask of the [B, K] result.

    XLA glue (estimated): q rotation / quantization / split / padding, the block table offset by the layer.
    Ideal and reference_bytes as `indexer_topk_traffic`'s (the live keys + scales read once is the reference).
    """
    from pallas_kernels.indexer_topk.kernel_mosaic import HEADS, PAGES_PER_BLOCK as PPB

    B, I, D, K = batch, index_heads, index_dim, topk
    quantized = _quantized_keys(key_dtype)  # fp8 / MXFP4 keys: q quantized as they are
    key_bytes = index_key_bytes(key_dtype, D)
    qb_in = dtype_bytes(query_dtype)
    T = 3 if (qb_in == 4 and not quantized) else 1
    MP = max_pages if max_pages is not None else _cdiv(seq_len, PAGE)
    lens = [min(max(int(n), 0), MP * PAGE) for n in (seq_lens if seq_lens is not None else [seq_len] * B)]
    if len(lens) != B:
        raise ValueError(f"seq_lens has {len(lens)} rows, batch is {B}")
    Ip = _cdiv(I, HEADS) * HEADS
    MPp = _cdiv(MP, PPB) * PPB
    Sp = MPp * PAGE
    blocks = B * (MPp // PPB)
    live_pages = sum(_cdiv(n, PAGE) for n in lens)
    key_page = PAGE * key_bytes
    passes = [
        Pass("xla: q / w prep", B * I * (D * qb_in + F32), B * Ip * (T * D * 2 + F32), 0, "xla"),
        Pass("xla: block table (layer offset, pad)", B * MP * I32, B * MPp * I32, 0, "xla"),
        Pass("scores (mosaic)", blocks * (I32 + PPB * I32 + Ip * T * D * 2 + Ip * F32) + live_pages * key_page,
             B * Sp * I32),
        Pass("xla: top-k (estimated)", TOPK_SORT_PASSES * B * Sp * 2 * I32 + B * I32,
             TOPK_SORT_PASSES * B * Sp * 2 * I32 + B * K * I32, 0, "xla"),
    ]
    keys_once = sum(n * key_bytes for n in lens)
    ideal = B * I * (D * qb_in + F32) + B * I32 + live_pages * I32 + keys_once + B * K * I32
    why = (f"The live keys are read once ({keys_once} B) and q once per {PPB} pages; the scores are written once "
           f"(4 B per position) and XLA's top-k is estimated at {TOPK_SORT_PASSES} radix passes over (key, index) "
           "pairs (16 B per position each).")
    excess = {"scores written": B * Sp * I32,
              "top-k (estimated)": 2 * TOPK_SORT_PASSES * B * Sp * 2 * I32,
              "q / w re-read per block": blocks * (Ip * T * D * 2 + Ip * F32) - B * I * (D * qb_in + F32)}
    return _make(passes, ideal, why, keys_once, excess)


# ----- sparse gather (the resolver) -----------------------------------------------------------------------
def sparse_gather_traffic(batch: int, topk: int, hot_rows: int, max_pages: int, *,
                          resident: int | None = None, hits: int | None = None, misses: int | None = None,
                          resident_frac: float = 0.25, hit_frac: float = 0.5, no_copy: int = 0,
                          live_rows: int | None = None, hot_rows_live: int | None = None,
                          scan_tiles: int | None = None, select_rows: int | None = None, select_passes: int = 0,
                          hot_pages_width: int | None = None, out_of_range: int = 0) -> Traffic:
    """`sparse_gather(topk [B, K], req, block_table / host_table [Rq, MP], hot_pages [Rq, NH],
    hot_token / hot_stamp [Rq, HR], clock, hot_rows=HR)`; all tables int32.

    The traffic depends on the plan, given as totals over the B rows (defaults: every row live with a hot
    buffer, every top-k slot valid, resident = resident_frac of them, hits = hit_frac of the rest, the
    others misses): resident / hits / misses (kinds 1 / 2 / 3 of the lookup); no_copy: positions that
    wanted the hot buffer but have no hot or host copy (kind 0); live_rows (req >= 0), hot_rows_live (live
    with a hot buffer); scan_tiles: lookup tiles holding a position the hot buffer may serve (default every
    tile of a hot row: only they scan the HR tags); select_rows: hot rows with a miss (they select victims;
    default: every hot row when misses > 0); select_passes: passes over a row's HR stamps beyond the two every
    selecting row makes (the window histogram and the pick), summed over the rows: 0 when each row's m-th
    least recent key lies in the window ending at this step's stamps or is -1 (never used), else 1 + its radix
    passes (`gather_plan_counts` counts them); out_of_range: top-k lanes whose page index is >= MP. HR >= K
    (`check_shapes`).

    Tiles (kernel.py `tiles`): TK = min(TOPK_TILE, next_pow2(K)), Kp = K rounded up to TK.

    1. `_lookup_kernel`, grid (B, Kp / TK): `req_ref[b]`, the tile's top-k (TK * 4), the block-table gather
       (in-range lanes * 4), `hot_ok_ref[b]`, the host-table gather (wanting lanes * 4), and when a lane wants
       the hot buffer the request's whole tag row, HR * 4; writes kind and addr (TK * 8).
       The tag scan is HR * 4 per tile: Kp / TK * HR * 4 per hot row, the resolver's dominant term.
    2. `_assign_kernel`, grid (B,): `req_ref[b]`, `hot_ok_ref[b]`, the clock, the kinds (Kp * 4); on a hot row
       the addresses (Kp * 4) and the hit marks (w hits * 4); on a selecting row the stamps HR * 4 per pass
       (window histogram, [extremes and radix passes,] pick) and the victim list (w misses * 4). Then for
       every row (assign): kind, addr, topk (r Kp*12), order (r misses*4), hot_pages (r (hits+misses)*4),
       host_table (r misses*4); page, row, src (w Kp*12), hot_token (w misses*4), hot_stamp (w (hits+misses)*4).

    XLA glue (estimated): `has_hot_buffer` (B rows of hot_pages), top-k padding when Kp > K, and the
    outputs valid / resident / miss (bool) and src_row from the kinds and the top-k.
    Ideal: top-k, req, per row min(K, MP) entries of each table, the hot_pages row, hot_token and hot_stamp
    rows read once; the plan (4 int32 + 3 bool per slot) and both state rows written once.
    reference_bytes: one read of the hot state (hot_token + hot_stamp + hot_pages rows): the v2 target is
    that nothing but this grows with HR.
    """
    B, K, HR, MP = batch, topk, hot_rows, max_pages
    if HR < K:
        raise ValueError(f"hot_rows={HR} must be >= K={K}")
    TK, Kp, _, _ = gather_tiles(K, HR)
    NH = hot_pages_width if hot_pages_width is not None else _cdiv(HR, PAGE)
    live = B if live_rows is None else live_rows
    hot = live if hot_rows_live is None else hot_rows_live
    valid = B * K
    if resident is None:
        resident = round(resident_frac * valid)
    if hits is None:
        hits = round(hit_frac * (valid - resident))
    if misses is None:
        misses = valid - resident - hits - no_copy
    want = hits + misses + no_copy
    in_range = B * Kp - out_of_range
    tiles = scan_tiles if scan_tiles is not None else hot * (Kp // TK)
    selecting = select_rows if select_rows is not None else (hot if misses else 0)

    lookup = Pass("lookup", B * (Kp // TK) * (2 * I32 + TK * I32) + in_range * I32 + want * I32 + tiles * HR * I32,
                  B * Kp * 2 * I32)
    stamp_passes = (2 * selecting + select_passes) * HR * I32
    lru_r = hot * Kp * I32 + stamp_passes  # addresses (hit marks), stamp passes
    lru_w = hits * I32 + misses * I32  # hit marks, victim list
    assign = Pass("assign", B * (3 * I32 + Kp * I32) + lru_r + B * Kp * 3 * I32 + misses * I32
                  + (hits + misses) * I32 + misses * I32,
                  lru_w + B * Kp * 3 * I32 + misses * I32 + (hits + misses) * I32)
    glue = [Pass("xla: has_hot_buffer", B * I32 + B * NH * I32, B * I32, 0, "xla")]
    if Kp != K:
        glue.append(Pass("xla: top-k pad", B * K * I32, B * Kp * I32, 0, "xla"))
    sliced = B * K * 3 * I32 if Kp != K else 0  # page / row / src_page [:, :K] copies
    glue.append(Pass("xla: plan outputs", B * K * 2 * I32 + sliced, B * K * (3 + I32) + sliced, 0, "xla"))
    passes = [glue[0], *glue[1:-1], lookup, assign, glue[-1]]
    state_once = B * (2 * HR + NH) * I32
    ideal = (B * K * I32 + B * I32 + 2 * B * min(K, MP) * I32 + state_once  # reads
             + B * K * (4 * I32 + 3) + 2 * B * HR * I32)  # writes
    per_row = stamp_passes / selecting / HR if selecting else 0.0
    why = (f"The lookup scans a hot row's {HR} tags once per {TK}-position tile ({Kp // TK} x HR x 4 B per row); "
           f"victim selection reads a selecting row's stamps {per_row / I32:.1f} times ({per_row:.0f} B per slot).")
    excess = {"tag scans (lookup)": tiles * HR * I32 - hot * HR * I32,
              "stamp passes (assign)": stamp_passes - hot * HR * I32}
    return _make(passes, ideal, why, state_once, excess)


def selection_passes(keys, m: int, clock: int) -> int:
    """Passes over a row's stamps beyond the window histogram and the pick, for victim selection over the
    untouched slots' LRU keys `keys` (int array, hit slots removed) with m >= 1 misses: the kernel's
    `select_victims` decisions, in NumPy (0 when the m-th smallest key lies in [2 clock - NB + 2, 2 clock + 1]
    or is -1, never used)."""
    import numpy as np

    keys = np.maximum(np.asarray(keys, np.int64), -1)
    base = 2 * clock - (SELECT_BUCKETS - 2)
    below = int((keys < base).sum())
    if below < m <= int((keys < base + SELECT_BUCKETS).sum()) or int((keys == -1).sum()) >= m:
        return 0
    if below >= m:
        lo, hi = int(keys.min()), base - 1
    else:
        lo, hi = int(keys[keys >= 2 * clock + 2].min()), int(keys.max())
    passes, shift, v = 1, max((hi - lo).bit_length() - SELECT_BITS, 0), lo  # the extremes pass, then radix
    while True:
        passes += 1
        below = int((keys < v).sum())
        if below + int((keys == v).sum()) >= m or shift == 0:
            return passes
        d = 0
        while below + int(((keys >= v) & (keys < v + ((d + 1) << shift))).sum()) < m:
            d += 1
        v, shift = v + (d << shift), max(shift - SELECT_BITS, 0)


def gather_plan_counts(topk, req, block_table, hot_pages, hot_token, hot_stamp, clock, valid, resident, miss, *,
                       hot_rows: int) -> dict:
    """The plan keywords of `sparse_gather_traffic` for one call, from its inputs (topk, req, block_table,
    hot_pages, hot_token, hot_stamp, clock: the state *before* the call) and its valid / resident / miss outputs
    (array-likes; uses NumPy, imported here)."""
    import numpy as np

    topk, req, block_table, hot_pages, hot_token, hot_stamp = (
        np.asarray(a) for a in (topk, req, block_table, hot_pages, hot_token, hot_stamp))
    valid, resident, miss = (np.asarray(a, bool) for a in (valid, resident, miss))
    B, K = topk.shape
    MP = block_table.shape[1]
    TK, Kp, _, _ = gather_tiles(K, hot_rows)
    live = req >= 0
    r = np.maximum(req, 0)
    hot_ok = live & np.all(hot_pages[r, :_cdiv(hot_rows, PAGE)] >= 0, axis=1)
    lp = np.maximum(topk, 0) // PAGE
    in_range = lp < MP
    dpage = np.where(in_range, block_table[r[:, None], np.where(in_range, lp, 0)], -1)
    want = (topk >= 0) & live[:, None] & (dpage < 0) & hot_ok[:, None]
    hits = valid & ~resident & ~miss
    wantp = np.pad(want, ((0, 0), (0, Kp - K)))
    select_rows, select_passes = 0, 0
    for b in np.nonzero(hot_ok & miss.any(axis=1))[0]:
        tags = hot_token[r[b]]
        hit_slots = {int(np.argmax(tags == t)) for t in topk[b][hits[b]]}  # the lowest slot holding t
        untouched = np.ones(hot_rows, bool)
        untouched[list(hit_slots)] = False
        select_rows += 1
        select_passes += selection_passes(hot_stamp[r[b]][untouched], int(miss[b].sum()), int(clock))
    return dict(resident=int(resident.sum()), hits=int(hits.sum()), misses=int(miss.sum()),
                no_copy=int((want & ~hits & ~miss).sum()), live_rows=int(live.sum()),
                hot_rows_live=int(hot_ok.sum()), scan_tiles=int(wantp.reshape(B, Kp // TK, TK).any(axis=2).sum()),
                select_rows=select_rows, select_passes=select_passes, out_of_range=int((~in_range).sum()))


# ----- sparse MLA decode ----------------------------------------------------------------------------------
def sparse_mla_decode_traffic(batch: int, heads: int, latent_dim: int, rope_dim: int, topk: int, *,
                              kv_dtype: str = "fp8", query_dtype: str = "bfloat16", rope_dtype: str = "bf16",
                              valid_rows: int | None = None, out_dtype: str = "float32") -> Traffic:
    """`sparse_mla_decode(q_lat [B, H, C], q_rope [B, H, R], latent_pages, rope_pages, page / row / valid
    [B, K], tau, latent_scale, layer, out_dtype)` on the Triton backend (kernel.py, the decode `kernels="pallas"`
    runs on a GPU). kv_dtype: the latent pool ("fp8": e4m3 + one f32 scale per 128 values, "bf16", "float32");
    rope_dtype: the rope pool; query_dtype: q_lat's and q_rope's; valid_rows: selected rows that are valid, over
    the batch (default B * K); out_dtype "float32" or "bfloat16".

    Blocks (kernel.py `decode_blocks`): BH = next_pow2(H) clamped to [16, 64], HB = ceil(H / BH) head blocks,
    BK = 32, CC = min(C, 128), S = max(1, min(K / BK, next_pow2(ceil(MIN_PROGRAMS / (B * HB))))) splits of
    `steps` row blocks, Kp = S * steps * BK. Grid (B, HB, S); per program: `layer_ref[0]` (4 B), its live heads'
    q_lat and q_rope (min(BH, H - h0) * (C + R) * q bytes: masked gathers, padded heads read nothing), then per
    step of BK rows `page_ref` and `row_ref` slices (BK * 8, unmasked) and for each valid row (masked gathers)
    the rope (R * rope bytes), the latent (C * kv bytes) and, for fp8, one 4-byte scale per CC chunk. With S = 1
    it writes its live heads' answer [h, C] in out_dtype; with S > 1 f32 partials [h, C] and m, l [h].

    So every selected row is read, and an fp8 row decoded, once per head block: HB times (2 at H = 128, once at
    H <= 64); with S > 1 the split-K partials (S * B * H * (C + 2) * 4) go to memory and come back for the merge.

    XLA glue (estimated): addr = where(valid, page, -1) (+ padding to Kp), row padding when Kp > K, and with
    S > 1 the split merge (reads the partials, writes [B, H, C] in out_dtype).
    Ideal: q_lat, q_rope, page, row (int32), valid (bool) and the valid rows (latent + rope + fp8 scales)
    read once, the output written once. reference_bytes: the valid rows read once.
    """
    from pallas_kernels.sparse_mla_decode.kernel import decode_blocks

    B, H, C, R, K = batch, heads, latent_dim, rope_dim, topk
    blk = decode_blocks(B, H, C, K)
    cc, hb, S, kp = blk["cc"], blk["hblocks"], blk["splits"], blk["kp"]
    lb, rb, qb, ob = (dtype_bytes(d) for d in (kv_dtype, rope_dtype, query_dtype, out_dtype))
    fp8 = lb == 1
    if fp8 and C % FP8_BLOCK:
        raise ValueError(f"fp8 needs C a multiple of {FP8_BLOCK}")
    n_valid = B * K if valid_rows is None else valid_rows
    row_bytes = C * lb + R * rb + ((C // cc) * F32 if fp8 else 0)
    programs = B * hb * S
    out_bytes = B * H * C * ob if S == 1 else S * B * H * (C + 2) * F32
    kernel = Pass("sparse_mla_decode",
                  programs * I32 + S * B * H * (C + R) * qb + B * hb * kp * 2 * I32 + hb * n_valid * row_bytes,
                  out_bytes)
    passes = [_mla_address_glue(B, K, kp), kernel]
    if S > 1:
        passes.append(Pass("xla: split merge", S * B * H * (C + 2) * F32, B * H * C * ob, 0, "xla"))
    rows_once = n_valid * row_bytes
    ideal = B * H * (C + R) * qb + B * K * (2 * I32 + 1) + rows_once + B * H * C * ob
    why = (f"Each selected row ({row_bytes} B) is read" + (", and decoded from fp8," if fp8 else "")
           + f" by each of the {hb} head block(s) of {blk['bh']} heads; "
           + (f"{S} splits write f32 partials [{S}, B, {H}, {C}] that the merge reads back." if S > 1 else
              f"one split: the kernel writes the normalized answer ({out_dtype})."))
    excess = {"rows re-read by the other head blocks": (hb - 1) * rows_once,
              "split-K partials (write + merge read)": 2 * S * B * H * (C + 2) * F32 if S > 1 else 0,
              "q re-read by every split": (S - 1) * B * H * (C + R) * qb}
    return _make(passes, ideal, why, rows_once, excess, conversions=hb if fp8 else 0)


def _decode_head_blocks(B: int, H: int, C: int, K: int) -> int:
    from pallas_kernels.sparse_mla_decode.kernel import decode_blocks
    return decode_blocks(B, H, C, K)["hblocks"]


def _mla_address_glue(B: int, K: int, kp: int) -> Pass:
    """The Triton decode's addresses: addr = where(valid, page, -1) padded to Kp, row padded when Kp > K."""
    return Pass("xla: addresses", B * K * (I32 + 1) + (B * K * I32 if kp != K else 0),
                B * kp * I32 * (2 if kp != K else 1), 0, "xla")


def sparse_mla_decode_compact_traffic(batch: int, heads: int, latent_dim: int, rope_dim: int, topk: int, *,
                                      kv_dtype: str = "fp8", query_dtype: str = "bfloat16",
                                      valid_rows: int | None = None, out_dtype: str = "float32") -> Traffic:
    """A variant that is modelled, not built: a fused gather-and-dequantize pass writes the step's selected rows
    as a compact bf16 [B, K, C + R] buffer (each fp8 row decoded once; invalid slots written as zeros), then the
    Triton decode above runs on it as on bf16 pools whose rows are contiguous (same blocks: each row read once
    per head block, no scales). Same arguments as `sparse_mla_decode_traffic` (the rope pool bf16).

    Against the in-place decode it adds the compact buffer's write and trades the fp8 rows' re-reads for bf16
    ones (1152 B instead of 656 B): at B 32, H 128, K 2048, bf16 queries, fp8 pools 285 MB (5.0x the ideal)
    against the in-place decode's 101 MB (1.78x); it converts each fp8 row once instead of twice. With bf16 pools
    it only adds a copy of the rows (317 MB against 166 MB). Hence the built decode reads the pools in place."""
    B, H, C, R, K = batch, heads, latent_dim, rope_dim, topk
    lb = dtype_bytes(kv_dtype)
    fp8 = lb == 1
    n_valid = B * K if valid_rows is None else valid_rows
    pool_row = C * lb + R * 2 + ((C // FP8_BLOCK) * F32 if fp8 else 0)
    compact_row = (C + R) * 2
    gather = Pass("gather + dequantize (modelled)", B * K * (2 * I32 + 1) + n_valid * pool_row, B * K * compact_row)
    decode = sparse_mla_decode_traffic(B, H, C, R, K, kv_dtype="bf16", query_dtype=query_dtype,
                                       valid_rows=n_valid, out_dtype=out_dtype)
    passes = [gather, *decode.passes]
    rows_once = n_valid * pool_row
    ideal = B * H * (C + R) * dtype_bytes(query_dtype) + B * K * (2 * I32 + 1) + rows_once + B * H * C * dtype_bytes(
        out_dtype)
    why = (f"The selected rows are read once ({pool_row} B each) and written compact ({compact_row} B, bf16); "
           f"the bf16 decode then reads each compact row once per head block.")
    hb = _decode_head_blocks(B, H, C, K)
    excess = {"compact rows written": B * K * compact_row,
              "compact rows read by the decode": hb * n_valid * compact_row - rows_once}
    return _make(passes, ideal, why, rows_once, excess, conversions=1 if fp8 else 0)


def sparse_mla_decode_mosaic_traffic(batch: int, heads: int, latent_dim: int, rope_dim: int, topk: int, *,
                                     kv_dtype: str = "fp8", query_dtype: str = "bfloat16",
                                     valid_rows: int | None = None, splits: int | None = None,
                                     out_dtype: str = "float32") -> Traffic:
    """`sparse_mla_decode(..., backend="mosaic")` (kernel_mosaic.py), same arguments as
    `sparse_mla_decode_traffic` (kv_dtype "fp8" or "bf16"; the rope pool is bf16) plus the wrapper's `splits`
    and `out_dtype` ("float32" or "bfloat16": what the tiered step asks for with bf16 queries).

    Grid (`kernel_mosaic.decode_grid`, `head_cluster`): B x Hp / 64 x S CUDA blocks of 64 heads, in clusters of
    cs = 2 neighbouring head blocks when the head blocks pair up (else 1); S splits of `steps` blocks of BK = 32
    rows, Kp = S * steps * BK. Per CUDA block, TMA copies: q (64 heads x (C + R) bf16) and the split's addresses
    (steps * BK * 4); then per block of rows, per cluster, one multicast copy per VALID row of its latent
    (C * kv bytes) (an invalid slot's address is out of bounds: TMA reads nothing and fills zeros), and per
    block one copy of its rope (R * 2) and for fp8 of its C / 128 f32 scales (at least SCALE_COPY values: 16
    bytes). Those are not multicast: a block's half would land in shared memory at an offset that is not 128-byte
    aligned (`kernel_mosaic.TMA_ALIGN`). Writes o [64, C] (out_dtype when S = 1, else f32 partials) and m, l [64]
    f32.

    So every selected row's latent is read once per cluster of heads: Hp / (64 cs) times (once at H = 128), its
    rope and scales once per 64 heads, and with S > 1 the split-K partials go to memory and come back for the
    merge (S = 1: the kernel normalizes and writes the answer).

    XLA glue (estimated): q cast to bf16 and head padding, the flat addresses (reads layer/page/row/valid,
    writes [B, Kp] int32), and the split merge (S > 1) or the slice of padded heads (S = 1, Hp > H).
    Ideal as `sparse_mla_decode_traffic` with the output in out_dtype; reference_bytes: the valid rows (latent,
    rope, fp8 scales) read once.
    """
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import BLOCK_ROWS, HEADS, SCALE_COPY, decode_grid, head_cluster

    B, H, C, R, K = batch, heads, latent_dim, rope_dim, topk
    lb, qb, ob = dtype_bytes(kv_dtype), dtype_bytes(query_dtype), dtype_bytes(out_dtype)
    if lb not in (1, 2):
        raise ValueError(f"the Mosaic kernel reads bf16 or fp8 latent pools, got {kv_dtype!r}")
    if ob not in (2, 4):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype!r}")
    fp8 = lb == 1
    hp, S, steps = decode_grid(B, H, K, splits)
    cs = head_cluster(hp)
    kp = S * steps * BLOCK_ROWS
    hblocks = hp // HEADS
    n_valid = B * K if valid_rows is None else valid_rows
    nblk = C // FP8_BLOCK
    row_bytes = C * lb + R * 2
    scale_bytes = nblk * F32 if fp8 else 0
    scale_copy = max(nblk, SCALE_COPY) * F32 if fp8 else 0
    blocks = B * hblocks * S
    kernel_out = ob if S == 1 else F32
    kernel = Pass("sparse_mla_decode (mosaic)",
                  blocks * HEADS * (C + R) * 2 + blocks * steps * BLOCK_ROWS * I32
                  + (hblocks // cs) * n_valid * C * lb + hblocks * n_valid * (R * 2 + scale_copy),
                  blocks * HEADS * (C * kernel_out + 2 * F32))
    glue = []
    if hp != H or qb != 2:
        glue.append(Pass("xla: q to bf16, head padding", B * H * (C + R) * qb, B * hp * (C + R) * 2, 0, "xla"))
    glue.append(Pass("xla: addresses", I32 + B * K * (2 * I32 + 1), B * kp * I32, 0, "xla"))
    if S > 1:
        tail = [Pass("xla: split merge", S * B * hp * (C + 2) * F32, B * H * C * ob, 0, "xla")]
    else:  # one split: normalized in the kernel; only padded heads cost a slice copy
        tail = [Pass("xla: head slice", B * H * C * ob, B * H * C * ob, 0, "xla")] if hp != H else []
    passes = [*glue, kernel, *tail]
    rows_once = n_valid * (row_bytes + scale_bytes)
    ideal = B * H * (C + R) * qb + B * K * (2 * I32 + 1) + rows_once + B * H * C * ob
    why = (f"Each selected row's latent ({C * lb} B) is read by {hblocks // cs} cluster(s) of {cs} x {HEADS} heads, "
           f"its rope ({R * 2} B) and {scale_bytes} B of scales by each of the {hblocks} blocks; "
           + (f"{S} splits write f32 partials [{S}, B, {hp}, {C}] that the merge reads back." if S > 1 else
              f"one split: the kernel writes the normalized answer ({out_dtype})."))
    excess = {"latent re-read by the other head clusters": (hblocks // cs - 1) * n_valid * C * lb,
              "rope read by every head block (not multicast)": (hblocks - 1) * n_valid * R * 2,
              "fp8 scales read by every head block (16-byte copies)": hblocks * n_valid * scale_copy
              - n_valid * scale_bytes if fp8 else 0,
              "split-K partials (write + merge read)": 2 * S * B * hp * (C + 2) * F32 if S > 1 else 0,
              "q cast to bf16 / padded (written, read back)": 2 * B * hp * (C + R) * 2 if hp != H or qb != 2 else 0,
              "q re-read by every split": (S - 1) * B * hp * (C + R) * 2}
    return _make(passes, ideal, why, rows_once, excess, conversions=hblocks if fp8 else 0)


def roofline(traffic: Traffic, measured_s: float, rw_bytes_per_s: float) -> dict:
    """The model's time at a measured read + write traffic rate, and model time / measured time."""
    model_s = traffic.time_s(rw_bytes_per_s)
    return {"model_s": model_s, "roofline_fraction": model_s / measured_s if measured_s > 0 else None}


def production_shapes() -> dict:
    """The shapes of `experiments/kernel_traffic.py` (FACTS.md: DeepSeek-V3.2 / GLM-5 decode)."""
    return {
        "indexer_topk": [dict(batch=4, index_heads=64, index_dim=128, seq_len=s, topk=2048, key_dtype="fp8",
                              query_dtype="bfloat16") for s in (8192, 32768, 131072)],
        "indexer_topk_mosaic": [dict(batch=4, index_heads=64, index_dim=128, seq_len=s, topk=2048, key_dtype="fp8",
                                     query_dtype="bfloat16") for s in (8192, 32768, 131072)],
        "sparse_gather": [dict(batch=64, topk=2048, hot_rows=hr, max_pages=2048) for hr in (4096, 8192, 16384)],
        # the decodes at the shape of the first GPU runs (B 32, H 128, top-k 2048), fp8 and bf16 latent pools
        "sparse_mla_decode": [dict(batch=32, heads=h, latent_dim=512, rope_dim=64, topk=2048, kv_dtype=kv,
                                   query_dtype=q) for h in (128, 16) for kv in ("fp8", "bf16")
                              for q in ("bfloat16", "float32")],
        "sparse_mla_decode_compact": [dict(batch=32, heads=128, latent_dim=512, rope_dim=64, topk=2048, kv_dtype=kv,
                                           query_dtype="bfloat16") for kv in ("fp8", "bf16")],
        # the Mosaic decode as the tiered step calls it: bf16 output for bf16 queries (see tiered.py)
        "sparse_mla_decode_mosaic": [dict(batch=64, heads=h, latent_dim=512, rope_dim=64, topk=2048, kv_dtype="fp8",
                                          query_dtype=q, out_dtype=q) for h in (128, 16)
                                     for q in ("bfloat16", "float32")],
    }
