"""The Mosaic GPU sparse-MLA decode kernel == its reference, in Mosaic GPU's interpret mode with race detection.

Same cases as tests/e2e/test_kernel_sparse_mla_decode.py (NaN-poisoned pools, permuted block tables, invalid
top-k slots scattered among the valid ones and addressed at poisoned rows), through the public
`sparse_mla_decode(..., backend="mosaic")`. Interpret mode simulates both warpgroups, the TMA engine and
the barriers; `detect_races=True` raises on any unsynchronized shared-memory access, and uninitialized
shared memory reads as NaN, so a missed wait or a stale buffer shows up as a race or as NaN.
The kernel's operands are bf16 (fp32 accumulation), so outputs are compared to ~1e-2 of the reference's
largest magnitude, and to the Triton kernel's bf16 path. Needs jax >= 0.11 (the newest-jax CI leg).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from pallas_kernels.sparse_mla_decode.kernel_mosaic import sparse_mla_decode_mosaic
from test_kernel_sparse_mla_decode import TAU, make_case

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    HAVE_INTERPRET = hasattr(plgpu, "force_gpu_interpret_mode")
except ImportError:  # pragma: no cover
    plgpu, HAVE_INTERPRET = None, False

needs_interpret = pytest.mark.skipif(
    not HAVE_INTERPRET, reason=f"Mosaic GPU interpret mode needs jax >= 0.11 (this is jax {jax.__version__})")


def run_mosaic(args, kw, splits=None, **extra):
    params = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
    with plgpu.force_gpu_interpret_mode(params):
        if splits is None:
            return np.asarray(sparse_mla_decode(*args, tau=TAU, backend="mosaic", **kw, **extra))
        return np.asarray(sparse_mla_decode_mosaic(*args, tau=TAU, splits=splits, **kw, **extra))


def check(args, kw, rtol=1e-2, splits=None, **extra):
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw, **extra))
    out = run_mosaic(args, kw, splits, **extra)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.all(np.isfinite(out)), "NaN/inf: a poisoned or uninitialized row reached the output"
    err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)
    assert err <= rtol, err
    return ref, out


@needs_interpret
@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_matches_reference(kv):
    check(*make_case(0, kv=kv, C=512))


@needs_interpret
@pytest.mark.parametrize("seq_len", [1, 31, 32, 33, 63, 64, 65])
def test_seq_len_boundaries(seq_len):
    """K = 40 against row blocks of 32: lengths around a block, the top-k and a page; mixed in one batch."""
    check(*make_case(seq_len, seq_lens=[seq_len, 65, 1], kv="bfloat16", C=256))


@needs_interpret
@pytest.mark.parametrize("H,K", [(20, 33), (72, 97), (1, 1)])
def test_awkward_heads_and_topk(H, K):
    """Heads padded to the 64-head block (H = 72: two blocks), K not a multiple of the row block."""
    check(*make_case(H + K, H=H, K=K, C=256, kv="bfloat16", seq_lens=[K + 3, K, max(K - 1, 1)]))


@needs_interpret
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_pipeline_steps_and_splits(splits, kv):
    """K = 200: 7 row blocks, as 7 splits of one step (default at B = 1), one split of 7 steps (the row copies
    of block i + 1 issued while block i computes, the score exchange alternating buffers) or 3 splits of
    3 steps (the last split partly past K: all padding)."""
    check(*make_case(9, B=1, K=200, C=256, kv=kv, seq_lens=[300]), splits=splits)


@needs_interpret
@pytest.mark.parametrize("H,kv,splits", [(128, "fp8", 1), (128, "bfloat16", 3), (256, "fp8", None),
                                         (136, "bfloat16", 1)])
def test_head_block_clusters(H, kv, splits):
    """Head blocks paired into clusters of 2 that share every row copy (multicast) and gate the next copies on
    a cluster barrier: H = 128 (one cluster), 256 (two), and 136 (three 64-head blocks: no cluster); several
    pipeline steps per split, so the cluster barrier turns over."""
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import decode_grid, head_cluster

    assert head_cluster(decode_grid(1, H, 200)[0]) == (1 if H == 136 else 2)
    check(*make_case(H, B=1, H=H, K=200, C=256, kv=kv, seq_lens=[300]), splits=splits)


@needs_interpret
@pytest.mark.parametrize("splits", [1, 3])
def test_bfloat16_output(splits):
    """out_dtype=bfloat16: the kernel writes (one split) or the merge rounds (several) the f32 result once; as
    close to the reference's rounded output as the f32 outputs are to each other."""
    args, kw = make_case(11, B=2, H=128, K=100, C=256, kv="fp8")
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw, out_dtype=jnp.bfloat16).astype(jnp.float32))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")):
        out = sparse_mla_decode_mosaic(*args, tau=TAU, splits=splits, out_dtype=jnp.bfloat16, **kw)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    assert np.max(np.abs(out - ref)) <= 1e-2 * np.max(np.abs(ref))


@needs_interpret
def test_fp8_scales_of_the_last_row_of_the_pool():
    """A row's scale copy moves SCALE_COPY values: at C = 256 (two scales a row) the copy of the pool's last
    row runs past its end, where TMA fills zeros; the row's own scales must still be applied."""
    args, kw = make_case(12, B=1, K=8, C=256, kv="fp8", seq_lens=[8])
    q_lat, q_rope, lat, rope, page, row, valid = args
    P = lat.shape[0]
    rng = np.random.default_rng(0)
    lat = lat.at[P - 1, 63].set(jnp.asarray(rng.normal(size=lat.shape[-1]), jnp.float32).astype(lat.dtype))
    rope = rope.at[P - 1, 63].set(jnp.asarray(rng.normal(size=rope.shape[-1]), rope.dtype))
    scale = kw["latent_scale"].at[P - 1, 63].set(jnp.asarray([4.0, 0.25], jnp.float32))
    page, row, valid = page.at[0, 0].set(P - 1), row.at[0, 0].set(63), valid.at[0, 0].set(True)
    check((q_lat, q_rope, lat, rope, page, row, valid), dict(latent_scale=scale))


@needs_interpret
def test_cluster_choice_is_checked():
    """`cluster` must be 1 or 2 and pair the head blocks; cluster=1 at H = 128 (two lone blocks that each copy the
    rows) gives the same answer."""
    args, kw = make_case(13, B=1, H=128, K=9, C=256, kv="bfloat16", seq_lens=[9])
    for bad in (3, 0):
        with pytest.raises(ValueError, match="cluster must be 1 or 2"):
            sparse_mla_decode_mosaic(*args, tau=TAU, interpret=True, cluster=bad, **kw)
    small, small_kw = make_case(13, B=1, H=20, K=9, C=256, kv="bfloat16", seq_lens=[9])
    with pytest.raises(ValueError, match="divide the 1 head blocks"):
        sparse_mla_decode_mosaic(*small, tau=TAU, interpret=True, cluster=2, **small_kw)
    out = np.asarray(sparse_mla_decode_mosaic(*args, tau=TAU, interpret=True, cluster=1, **kw))
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    assert np.max(np.abs(out - ref)) <= 1e-2 * np.max(np.abs(ref))


@needs_interpret
def test_long_topk_takes_more_splits(monkeypatch):
    """A split holds at most MAX_STEPS row blocks (its addresses live in shared memory): asked for one split
    of 7 blocks with MAX_STEPS = 2, the kernel takes 4 splits and gives the same result."""
    from pallas_kernels.sparse_mla_decode import kernel_mosaic

    monkeypatch.setattr(kernel_mosaic, "MAX_STEPS", 2)
    args, kw = make_case(10, B=1, K=199, C=256, kv="bfloat16", seq_lens=[250])  # a shape no other test traces
    jaxpr = str(jax.make_jaxpr(lambda *a: sparse_mla_decode_mosaic(*a, tau=TAU, splits=1, **kw))(*args))
    assert "f32[4,1,64,256]" in jaxpr, "not 4 splits"
    check(args, kw, splits=1)


@needs_interpret
@pytest.mark.parametrize("splits", [None, 1])
def test_no_valid_row_gives_zeros(splits):
    """Merged splits, and one split (normalized in the kernel: l = 0 must give 0, not NaN)."""
    args, kw = make_case(2, kv="bfloat16", C=256)
    args = args[:6] + (jnp.zeros_like(args[6]).at[0].set(args[6][0]),)  # only sequence 0 has rows
    _, out = check(args, kw, splits=splits)
    assert np.all(out[1:] == 0) and np.any(out[0] != 0)


@needs_interpret
@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_layer_of_stacked_pools(kv):
    """`layer=` (traced) reads one layer of [L, P, 64, *] pools whose other layers are NaN."""
    args, kw = make_case(6, kv=kv, C=256)
    q_lat, q_rope, latent, rope, page, row, valid = args
    junk = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])  # noqa: E731
    stacked = (q_lat, q_rope, junk(latent), junk(rope), page, row, valid)
    kw3 = {k: junk(v) for k, v in kw.items()}
    want = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    out = run_mosaic(stacked, kw3, layer=jnp.int32(1))
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - want)) <= 1e-2 * np.max(np.abs(want))


@needs_interpret
def test_close_to_triton_bf16_path():
    """Both backends with bf16 operands agree with each other about as well as each with the reference."""
    args, kw = make_case(4, kv="bfloat16", C=256, q_dtype=jnp.bfloat16)
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    tri = np.asarray(sparse_mla_decode(*args, tau=TAU, interpret=True, **kw))
    mos = run_mosaic(args, kw)
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(mos - tri)) <= 1e-2 * scale


@needs_interpret
def test_interpret_flag_runs_without_a_context():
    args, kw = make_case(7, kv="bfloat16", C=256, B=1, K=8, seq_lens=[8])
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    out = np.asarray(sparse_mla_decode(*args, tau=TAU, backend="mosaic", interpret=True, **kw))
    assert np.max(np.abs(out - ref)) <= 1e-2 * np.max(np.abs(ref))


@pytest.mark.parametrize("bad, match", [
    (dict(kv="float32"), "bfloat16 or float8_e4m3fn"),
    (dict(kv="bfloat16", C=128), "multiple of 256"),
])
def test_refuses_unsupported_inputs(bad, match):
    args, kw = make_case(8, **bad)
    with pytest.raises((ValueError, NotImplementedError), match=match if HAVE_INTERPRET else "jax >= 0.11"):
        sparse_mla_decode(*args, tau=TAU, backend="mosaic", interpret=True, **kw)


def test_unknown_backend_is_refused():
    args, kw = make_case(8)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_mla_decode(*args, tau=TAU, backend="cuda", **kw)


@pytest.mark.parametrize("C,R", [(256, 64), (512, 64), (512, 128), (1024, 64)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cluster", [1, 2])
def test_tma_destinations_are_aligned(C, R, fp8, cluster):
    """Every TMA copy into shared memory starts on a TMA_ALIGN (128-byte) boundary, a multicast copy's share in
    each block of the cluster too: sm_90 faults otherwise, which interpret mode does not check. An H200 faulted on
    the fp8 scales' 16-byte rows (CUDA_ERROR_ILLEGAL_INSTRUCTION at H 16, CUDA_ERROR_MISALIGNED_ADDRESS at H 128);
    the rope (R * 2 bytes) and one row block's addresses (128 bytes), split in two shares, would start at 64."""
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import TMA_ALIGN, tma_destinations

    for steps in (1, 3, 64):
        for name, (pitch, share) in tma_destinations(C, R, fp8, cluster, steps).items():
            assert pitch % TMA_ALIGN == 0 and share % TMA_ALIGN == 0, (name, pitch, share)
