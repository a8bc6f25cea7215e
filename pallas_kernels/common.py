"""Formats shared by the kernels and by the store that feeds them (pure jnp; imports only jax and numpy).

* `PAGE`           tokens per page (rows of every paged pool)
* `INVALID`        the one "no page / no position / no slot" sentinel of every table and top-k list
* `fp8_quantize`   per-block e4m3 with power-of-two scales (the FP8 latent pool, the indexer's FP8 emulation)
* `mxfp4_quantize`, `mxfp4_dequantize`  MXFP4: E2M1 codes two per byte, one UE8M0 scale per 32 values (4-bit
                   indexer keys, as vLLM #48558 / SGLang #30546 store them: 68 bytes per 128-value key)
* `hadamard`       the Sylvester Hadamard rotation DeepSeek applies before quantizing indexer q and k
* `float_to_key`   f32 -> int32 whose signed order is the float order (the indexer kernels select on it)
* `check_triton_offsets`  refuses an operand Pallas-Triton would address past 2^31 with 32-bit offsets
* `fp8_words`, `e4m3_to_f32`  an e4m3 pool as uint32 words of four (so those offsets stay under 2^31), decoded
  (`word_planes`: from the bits; `e4m3_planes`: as e4m3 values the hardware converts)
* `int4_words`, `e2m1_to_f32`, `ue8m0_to_f32`  an MXFP4 pool as uint32 words of eight codes, decoded exactly
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

PAGE = 64
INVALID = -1
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_BLOCK = 128  # values per scale of the FP8 latent layout


def float_to_key(s):
    """f32 -> int32 whose signed order is the float order (-0.0 mapped to +0.0's key 0)."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(bits == jnp.int32(-(2**31)), 0, key)


def hadamard(x):
    """x [..., d] @ H_d / sqrt(d), H_d the Sylvester Hadamard matrix (d a power of two), at full float32 precision:
    a GPU's default float32 matmul rounds its operands to TF32 (10 mantissa bits), and a rotation that far off
    lets an exact zero come back as a small e4m3 / E2M1 value after quantization, so GPU and CPU would quantize
    the same keys differently (an H200 run showed it as near-tie top-k differences)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dimension, got {d}")
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return jnp.matmul(x, jnp.asarray(h / math.sqrt(d), x.dtype), precision=lax.Precision.HIGHEST)


def fp8_quantize(x, block: int = FP8_BLOCK):
    """Per-`block` e4m3 quantization with power-of-two scales 2^ceil(log2(max(amax, 1e-4) / 448)).

    x f32[..., d] -> (e4m3[..., d], f32[...] scale when d == block, else f32[..., d // block]).
    """
    d = x.shape[-1]
    b = min(block, d)
    xb = x.reshape(*x.shape[:-1], d // b, b)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-4) / FP8_MAX)))
    q = (xb / scale).astype(jnp.float8_e4m3fn).reshape(x.shape)
    scale = scale[..., 0]
    return q, (scale[..., 0] if d == b else scale)


MXFP4_BLOCK = 32  # values per UE8M0 scale (the OCP MX block)
E2M1_MAX = 6.0  # the largest E2M1 magnitude
# the E2M1 magnitudes of codes 0..7 (bit 3 of a code is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring magnitudes; a tie goes to the even code (round to nearest even), i.e. up
# where the lower code is odd
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
UE8M0_BIAS = 127


def _pow2(e):
    """2.0 ** e as float32, exactly, for integer e in [-126, 127] (built from its bits: XLA's exp2 is approximate);
    0.0 for e = -127 (byte 0 of UE8M0: an all-zero block)."""
    bits = jnp.where(e > -UE8M0_BIAS, (e + UE8M0_BIAS) << 23, 0).astype(jnp.int32)
    return lax.bitcast_convert_type(bits, jnp.float32)


def mxfp4_quantize(x):
    """MXFP4: x f32[..., d] (d a multiple of 32) -> (codes uint8[..., d / 2], scales uint8[..., d / 32]).

    Each block of 32 values shares the power-of-two scale 2^ceil(log2(amax / 6)) (no value is clipped: the same
    rule as `fp8_quantize`'s, against E2M1's largest magnitude 6; at least 2^-126), stored as its UE8M0 byte
    (exponent + 127; an all-zero block gets byte 0). Each value becomes the nearest E2M1 code of value / scale (ties
    to the even code): bit 3 the sign, bits 0-2 the index in `E2M1_VALUES`. Value 2 i is the low nibble of byte i,
    value 2 i + 1 the high one."""
    d = x.shape[-1]
    if d % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension that is a multiple of {MXFP4_BLOCK}, got {d}")
    x = x.astype(jnp.float32)
    xb = x.reshape(*x.shape[:-1], d // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    mant, exp = jnp.frexp(amax / E2M1_MAX)  # amax / 6 = mant 2^exp, mant in [0.5, 1): ceil(log2) = exp or exp - 1
    e = jnp.where(mant == 0.5, exp - 1, exp)
    # no subnormal scale (a CPU may flush it): blocks under 6 x 2^-126 share 2^-126; an all-zero block gets byte 0
    e = jnp.where(amax > 0, jnp.clip(e, 1 - UE8M0_BIAS, UE8M0_BIAS), -UE8M0_BIAS)
    v = jnp.abs(xb) * _pow2(-e)  # <= 6, exactly scaled
    mag = sum(((v >= t) if up else (v > t)).astype(jnp.uint8) for t, up in _E2M1_MIDPOINTS)
    code = (mag | jnp.where(xb < 0, 8, 0).astype(jnp.uint8)).reshape(x.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(jnp.uint8), (e[..., 0] + UE8M0_BIAS).astype(jnp.uint8)


MXFP4_PER_WORD = 8  # E2M1 codes per uint32 word (`int4_words`)


def int4_words(codes):
    """MXFP4 codes uint8[..., d / 2] viewed as uint32 words [..., d / 8] (a bitcast, no copy): bits 4 n .. 4 n + 3
    of word j are value 8 j + n (`mxfp4_quantize` puts value 2 i in the low nibble of byte i)."""
    *lead, nb = codes.shape
    return lax.bitcast_convert_type(codes.reshape(*lead, nb // 4, 4), jnp.uint32)


def e2m1_to_f32(code):
    """An E2M1 code (0..15 in an integer array: bit 3 the sign, bits 1-2 the exponent, bit 0 the mantissa) -> its
    f32 value, exactly, built from the bits (no table: the kernels cannot gather)."""
    code = code.astype(jnp.int32)
    e, m = (code >> 1) & 3, code & 1
    bits = jnp.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))  # m / 2, or (1 + m / 2) 2^(e - 1)
    return lax.bitcast_convert_type(bits | ((code & 8) << 28), jnp.float32)


def ue8m0_to_f32(s):
    """A UE8M0 scale byte (in an integer array) -> 2^(s - 127) as f32, exactly (0.0 for byte 0: an all-zero block;
    255, which MX reserves for NaN, gives inf)."""
    return lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


def mxfp4_dequantize(codes, scales):
    """codes uint8[..., d / 2], scales uint8[..., d / 32] (`mxfp4_quantize`'s) -> f32[..., d], exactly."""
    codes = codes.astype(jnp.int32)
    val = e2m1_to_f32(jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1]))
    d = val.shape[-1]
    scale = ue8m0_to_f32(scales)
    return (val.reshape(*val.shape[:-1], d // MXFP4_BLOCK, MXFP4_BLOCK) * scale[..., None]).reshape(val.shape)


TRITON_64BIT_BYTES = 2**32  # jax's Pallas-Triton lowering uses 64-bit offsets only for operands larger than this


def check_triton_offsets(name: str, x) -> None:
    """Refuse an operand a Pallas-Triton kernel would address with 32-bit offsets past 2^31 elements.

    jax's Pallas-Triton lowering (`_compute_offsets_from_indices`, jax 0.10 to 0.12) computes element offsets in
    int32 unless the operand is over 2^32 BYTES, and Triton's `addptr` sign-extends them: the elements past 2^31
    of a 1-byte operand (an fp8 pool) of 2-4 GiB would be read at negative offsets, silently (vLLM's HiSparse
    shipped this class of bug, #57602). Seen in the Triton IR of a 3 GiB fp8 operand (`tensor<...xi32>` offsets;
    5 GiB gets i64). Wider dtypes cannot get there: 2^31 of them are over 4 GiB."""
    size = math.prod(x.shape)
    nbytes = size * jnp.dtype(x.dtype).itemsize
    if size > 2**31 - 1 and nbytes <= TRITON_64BIT_BYTES:
        raise ValueError(
            f"{name} ({x.dtype}{list(x.shape)}, {nbytes / 2**30:.2f} GiB) has more than 2^31 elements but not more "
            f"than 4 GiB, so the Pallas-Triton kernel would address it with 32-bit offsets that overflow (jax uses "
            f"64-bit ones only above 4 GiB): size the store's pools outside 2-4 GiB for this dtype, or use "
            f"kernels='reference'")



FP8_PER_WORD = 4  # e4m3 values per uint32 word (`fp8_words`)


def fp8_words(x):
    """An e4m3 array [..., d] viewed as uint32 words [..., d / 4] (a bitcast: XLA makes no copy; byte m of word j,
    the (8 m)-th bits up, is element 4 j + m). jax's Pallas-Triton lowering addresses an operand of at most 4 GiB
    with int32 element offsets, so a 1-byte pool of 2-4 GiB would overflow them; as words it has at most 2^30
    elements, and above 4 GiB the lowering uses int64 offsets. Kernels read the words and `e4m3_to_f32` them."""
    *lead, d = x.shape
    return lax.bitcast_convert_type(x.reshape(*lead, d // FP8_PER_WORD, FP8_PER_WORD), jnp.uint32)


def e4m3_to_f32(b):
    """uint32 holding one float8_e4m3fn bit pattern (0..255) -> its f32 value, exactly (finite patterns; the NaN
    patterns come out as +-480, which only unread or masked rows hold)."""
    sign = (b & 0x80) << 24
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = lax.bitcast_convert_type(sign | ((exp + (127 - 7)) << 23) | (man << 20), jnp.float32)
    sub = man.astype(jnp.float32) * (2.0 ** -9)  # exponent field 0: man / 8 * 2^(1 - 7)
    return jnp.where(exp == 0, jnp.where(sign != 0, -sub, sub), normal)


def word_planes(words):
    """uint32 words [..., n] -> the FP8_PER_WORD e4m3 values of each word as f32 planes [..., n] (plane m holds
    elements 4 j + m)."""
    return [e4m3_to_f32((words >> (8 * m)) & 0xFF) for m in range(FP8_PER_WORD)]


def e4m3_planes(words):
    """uint32 words [..., n] -> the FP8_PER_WORD float8_e4m3fn planes [..., n] of the words (plane m holds elements
    4 j + m; each byte bitcast, no arithmetic): a kernel casts them, and on a GPU the cast is the hardware's e4m3
    conversion (sm_89 on; Pallas-Triton refuses it below) instead of `word_planes`' ~15 integer operations per
    value. Exact for every finite value; NaN patterns stay NaN."""
    return [lax.bitcast_convert_type(((words >> (8 * m)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
            for m in range(FP8_PER_WORD)]
