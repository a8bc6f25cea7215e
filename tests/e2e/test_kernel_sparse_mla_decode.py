"""Sparse absorbed-MLA decode over paged rows: Pallas (interpret) == reference == library math.

Pools are NaN-poisoned everywhere except the rows the top-k selects, pages come through a permuted block table,
and invalid top-k slots point at poisoned rows, so any stray read shows up as NaN. The CUDA
lowering test runs the Pallas -> Triton lowering at production shapes on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.compat import gpu_lowering_target
from hisparse_jax.kernel_cases import mla_case
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_rows as rows_reference
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from pallas_kernels.sparse_mla_decode.kernel import decode_blocks

TAU = 0.13523378


def make_case(seed, *, B=3, H=4, C=128, R=64, K=40, P=12, seq_lens=None, kv="float32", q_dtype=jnp.float32):
    """`kernel_cases.mla_case` on a pool of P pages: sequence b owns positions 0..seq_lens[b]-1 (default K + 7)
    through a permuted block table; its top-k is min(K, seq_len) of them (the rest -1 padding, addressed at
    poisoned rows); every row no valid slot selects is NaN."""
    return mla_case(seed, B=B, H=H, C=C, R=R, K=K, seq_lens=[K + 7] * B if seq_lens is None else seq_lens, pages=P,
                    kv=kv, q_dtype=q_dtype)


def check(args, kw, rtol=2e-6):
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    out = np.asarray(sparse_mla_decode(*args, tau=TAU, interpret=True, **kw))
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.all(np.isfinite(ref)) and np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)
    assert err <= rtol, err
    return ref, out


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "fp8"])
def test_kernel_matches_reference(kv):
    check(*make_case(0, kv=kv))


def test_bf16_queries_run_bf16_matmuls():
    """bf16 q: tensor-core numerics (p rounded to bf16 for p @ c), as FlashMLA; close, not exact."""
    args, kw = make_case(1, kv="bfloat16", q_dtype=jnp.bfloat16)
    check(args, kw, rtol=5e-3)


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 39, 40, 41, 200])
def test_seq_len_boundaries(seq_len):
    """K = 40: seq_len in {1, 63, 64, 65, K-1, K, K+1, several pages}; the batch mixes lengths."""
    check(*make_case(seq_len, seq_lens=[seq_len, 65, 1], kv="bfloat16"))


@pytest.mark.parametrize("H,K,C", [(20, 33, 64), (16, 1, 16), (2, 97, 256)])
def test_awkward_sizes(H, K, C):
    """Heads padded to the head block, K not a multiple of the row block, small / large latent widths."""
    check(*make_case(H + K + C, H=H, K=K, C=C, R=16 if C == 16 else 64, seq_lens=[K + 3, K, max(K - 1, 1)]))


@pytest.mark.parametrize("H,K,kv,splits", [(100, 24, "fp8", 1), (100, 70, "bfloat16", 3), (72, 40, "fp8", 2)])
def test_head_blocks_of_64(H, K, kv, splits):
    """H > 64: blocks of 64 heads, the last one padded (its heads past H neither read nor written), with one split
    (the kernel normalizes and writes the answer) and with several (f32 partials merged outside)."""
    assert (decode_blocks(3, H, 128, K)["bh"], decode_blocks(3, H, 128, K)["splits"]) == (64, splits)
    check(*make_case(H * K, H=H, K=K, kv=kv, seq_lens=[K + 5, K, 9]))


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_one_split_writes_bf16_answer(kv):
    """One split (K <= one row block), bf16 queries and output: the kernel rounds its normalized answer."""
    args, kw = make_case(21, H=80, K=32, kv=kv, q_dtype=jnp.bfloat16, seq_lens=[40, 32, 3])
    assert decode_blocks(3, 80, 128, 32)["splits"] == 1
    ref = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw), np.float32)
    out = sparse_mla_decode(*args, tau=TAU, interpret=True, out_dtype=jnp.bfloat16, **kw)
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=0, atol=1e-2 * np.max(np.abs(ref)))


def test_fp8_wide_latent_uses_every_scale():
    """C = 256: two fp8 scale blocks per row, each applied to its own 128 columns."""
    args, kw = make_case(5, C=256, kv="fp8")
    ref, _ = check(args, kw)
    kw_flat = dict(latent_scale=kw["latent_scale"].at[..., 1].multiply(2.0))
    assert not np.allclose(ref, np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw_flat)))


def test_no_valid_row_gives_zeros():
    args, kw = make_case(2)
    args = args[:6] + (jnp.zeros_like(args[6]).at[0].set(args[6][0]),)  # only sequence 0 has rows
    ref, out = check(args, kw)
    assert np.all(out[1:] == 0) and np.all(ref[1:] == 0) and np.any(out[0] != 0)


def test_reference_equals_library_math_on_gathered_rows():
    """The spec is the library's row-wise reference applied to the rows at the addresses."""
    args, kw = make_case(3, kv="fp8")
    q_lat, q_rope, latent, rope, page, row, valid = args
    c = latent[page, row].astype(jnp.float32)
    c = (c.reshape(*c.shape[:-1], -1, 128) * kw["latent_scale"][page, row][..., None]).reshape(c.shape)
    want = rows_reference(q_lat, q_rope, c, rope[page, row].astype(jnp.float32), valid, TAU)
    np.testing.assert_array_equal(np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw)), np.asarray(want))


@pytest.mark.parametrize("kv,shape", [("bfloat16", {}), ("fp8", {}), ("fp8", dict(H=70, K=30))])
def test_layer_of_stacked_pools(kv, shape):
    """`layer=` reads one layer of the store's [L, P, 64, *] pools in place (a traced layer index); the last case
    in two head blocks of 64 (padded) and one split."""
    args, kw = make_case(6, kv=kv, **shape)
    q_lat, q_rope, latent, rope, page, row, valid = args
    junk = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])  # noqa: E731
    stacked = (q_lat, q_rope, junk(latent), junk(rope), page, row, valid)
    kw3 = {k: junk(v) for k, v in kw.items()}
    want = np.asarray(sparse_mla_decode_reference(*args, tau=TAU, **kw))
    ref = np.asarray(sparse_mla_decode_reference(*stacked, tau=TAU, layer=1, **kw3))
    out = np.asarray(sparse_mla_decode(*stacked, tau=TAU, layer=jnp.int32(1), interpret=True, **kw3))
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * np.max(np.abs(want)))


def test_bfloat16_output_is_the_rounded_answer():
    """out_dtype=bfloat16 (reference and Triton kernel): the f32 answer rounded once; other dtypes are refused."""
    args, kw = make_case(14, kv="bfloat16")
    f32 = sparse_mla_decode_reference(*args, tau=TAU, **kw)
    ref = sparse_mla_decode_reference(*args, tau=TAU, **kw, out_dtype=jnp.bfloat16)
    out = sparse_mla_decode(*args, tau=TAU, interpret=True, **kw, out_dtype=jnp.bfloat16)
    assert ref.dtype == out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(f32.astype(jnp.bfloat16)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-6)
    for f in (sparse_mla_decode_reference, sparse_mla_decode):
        with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
            f(*args, tau=TAU, **kw, out_dtype=jnp.float16)


def test_rejects_unsupported_shapes():
    args, _ = make_case(0, C=96, K=8)
    with pytest.raises(ValueError, match="powers of two"):
        sparse_mla_decode(*args, tau=TAU, interpret=True)
    args, kw = make_case(0, C=64, K=8, kv="fp8")
    with pytest.raises(ValueError, match="multiple of 128"):
        sparse_mla_decode(*args, tau=TAU, interpret=True, **kw)
    args, _ = make_case(0, K=8, kv="fp8")
    with pytest.raises(ValueError, match="latent_scale is required"):
        sparse_mla_decode(*args, tau=TAU, interpret=True)


@pytest.mark.parametrize("H,kv,q_dtype", [(128, "bf16", jnp.bfloat16), (64, "fp8", jnp.bfloat16),
                                          (128, "fp8", jnp.float32), (64, "f32", jnp.float32)])
def test_lowers_for_cuda(H, kv, q_dtype):
    """Pallas -> Triton lowering at production shapes: B=32, C=512, R=64, K=2048, P=4096 pages."""
    B, C, R, K, P = 32, 512, 64, 2048, 4096
    sds = jax.ShapeDtypeStruct
    pool_dt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}[kv]
    args = [sds((B, H, C), q_dtype), sds((B, H, R), q_dtype), sds((P, 64, C), pool_dt),
            sds((P, 64, R), jnp.float32 if kv == "f32" else jnp.bfloat16), sds((B, K), jnp.int32),
            sds((B, K), jnp.int32), sds((B, K), jnp.bool_)]
    if kv == "fp8":
        args.append(sds((P, 64, C // 128), jnp.float32))
        fn = lambda *a: sparse_mla_decode(*a[:7], tau=TAU, latent_scale=a[7])  # noqa: E731
    else:
        fn = functools.partial(sparse_mla_decode, tau=TAU)
    with gpu_lowering_target():  # jax >= 0.11 needs the target GPU named
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_lowers_for_cuda_on_stacked_pools():
    """The store's whole fp8 pool (78 layers x 4096 pages: > 4 GiB, so 64-bit offsets) read at a traced layer."""
    B, H, C, R, K, P, L = 32, 64, 512, 64, 2048, 4096, 78
    sds = jax.ShapeDtypeStruct
    args = [sds((B, H, C), jnp.bfloat16), sds((B, H, R), jnp.bfloat16), sds((L, P, 64, C), jnp.float8_e4m3fn),
            sds((L, P, 64, R), jnp.bfloat16), sds((B, K), jnp.int32), sds((B, K), jnp.int32), sds((B, K), jnp.bool_),
            sds((L, P, 64, C // 128), jnp.float32), sds((), jnp.int32)]
    fn = lambda *a: sparse_mla_decode(*a[:7], tau=TAU, latent_scale=a[7], layer=a[8])  # noqa: E731
    with gpu_lowering_target():  # jax >= 0.11 needs the target GPU named
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("layers", [20, 7, 78])
def test_fp8_pools_are_addressed_as_words(layers):
    """jax's Pallas-Triton lowering uses 32-bit element offsets for operands up to 4 GiB, and Triton sign-extends
    them: an fp8 pool of 2-4 GiB (20 layers x 4096 pages: 2.5 GiB, over 2^31 elements) read as bytes would be read
    at negative offsets past 2^31. The kernel reads the fp8 latent as uint32 words (under 2^31 of them below 4 GiB;
    above it the lowering's offsets are 64-bit): the lowered CUDA call takes the words, at every size."""
    from hisparse_jax.compat import gpu_lowering_target

    B, H, C, R, K, P = 2, 16, 512, 64, 64, 4096
    sds = jax.ShapeDtypeStruct
    args = [sds((B, H, C), jnp.bfloat16), sds((B, H, R), jnp.bfloat16), sds((layers, P, 64, C), jnp.float8_e4m3fn),
            sds((layers, P, 64, R), jnp.bfloat16), sds((B, K), jnp.int32), sds((B, K), jnp.int32),
            sds((B, K), jnp.bool_), sds((layers, P, 64, C // 128), jnp.float32), sds((), jnp.int32)]
    fn = lambda *a: sparse_mla_decode(*a[:7], tau=TAU, latent_scale=a[7], layer=a[8])  # noqa: E731
    with gpu_lowering_target():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = text.split("__gpu$xla.gpu.triton")[1].split("\n")[0]  # the rest of the custom call's line: its operands
    assert f"tensor<{layers}x{P}x64x{C // 4}xui32>" in text, call[:400]
    assert f"{layers}x{P}x64x{C}xf8E4M3FN" not in call


def test_the_offset_guard_refuses_a_byte_operand_of_2_to_4_gib():
    """`check_triton_offsets`, which every Triton kernel applies to what it passes: a 1-byte operand of 2-4 GiB is
    refused naming it; the same bytes as uint32 words, or a byte operand under 2^31 elements or over 4 GiB, pass."""
    from pallas_kernels.common import check_triton_offsets, fp8_words

    sds = jax.ShapeDtypeStruct
    pool = sds((20, 4096, 64, 512), jnp.float8_e4m3fn)  # 2.5 GiB
    with pytest.raises(ValueError, match=r"latent_pages \(float8_e4m3fn.*2\.50 GiB\) .* 32-bit offsets"):
        check_triton_offsets("latent_pages", pool)
    check_triton_offsets("words", jax.eval_shape(fp8_words, pool))
    for layers in (7, 78):
        check_triton_offsets("latent_pages", sds((layers, 4096, 64, 512), jnp.float8_e4m3fn))


def test_e4m3_planes_are_the_words_values():
    """`common.e4m3_planes` (what the fp8 decode converts) gives back every e4m3 bit pattern of the words, plane m
    holding elements 4 j + m, and agrees with the bit decode (`word_planes`) on every finite pattern."""
    from pallas_kernels.common import e4m3_planes, fp8_words, word_planes

    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    x = jnp.asarray(bits).view(jnp.float8_e4m3fn)
    planes = e4m3_planes(fp8_words(x))
    for m, p in enumerate(planes):
        assert p.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(p).view(np.uint8), bits[:, m::4])
    finite = np.isfinite(np.asarray(x.astype(jnp.float32)))
    for m, (p, w) in enumerate(zip(planes, word_planes(fp8_words(x)))):
        got, want = np.asarray(p.astype(jnp.float32)), np.asarray(w)
        np.testing.assert_array_equal(got[finite[:, m::4]], want[finite[:, m::4]])
