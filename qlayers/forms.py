"""The kernel forms of a quantized GEMM: the ways of writing one 2-D GEMM
of two `QTensor` operands (or two wide arrays) that a platform turns into
its best kernel. `qlayers.dispatch` picks one per platform from its table
(`dispatch.TABLE`) and records it in the GEMM's plan; each form takes
``(a, b, out_dtype, axes)`` and returns the FP32-accumulated product.

The CPU forms are the numerical reference; the others only change how the
same product is computed on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import scaling
from qlayers.block_scaled_dot import block_scaled_dot
from qlayers.scaling import QTensor

__all__ = ["FORMS", "scaled_dot_mx", "contraction_last", "as_mx",
           "to_fnuz", "as_nvfp4"]


def _dims(a_axis: int, b_axis: int):
  return (((a_axis,), (b_axis,)), ((), ()))


def _scale_vector(q: QTensor) -> jax.Array:
  """Row-wise scales of a 2-D operand as a vector over its free dim."""
  if q.granularity == "tensor":
    return q.scale
  return jnp.squeeze(q.scale, axis=q.axis)


def _outer_scales(a: QTensor, b: QTensor):
  """``a``'s scales as a column and ``b``'s as a row of the output."""
  sa, sb = _scale_vector(a), _scale_vector(b)
  return (sa[:, None] if sa.ndim else sa), (sb[None, :] if sb.ndim else sb)


def _dot_f32(a: jax.Array, b: jax.Array, axes: tuple[int, int],
             **kwargs) -> jax.Array:
  """2-D ``dot_general`` of ``a`` and ``b`` over ``axes``, FP32 accumulation.

  On CPU, XLA runs a BF16 dot whose lhs contracts its first axis (the weight
  gradient ``x.T @ g``) as an FP32 dot on upcast copies, at about half the
  speed of its BF16 kernel (jax 0.10.2; benchmarks/RESULTS.md). Written as a
  contraction over ``(1, M)``, the same sum gets a physical transpose of
  ``a`` and the BF16 kernel. The barrier keeps XLA from folding a transpose
  of the result back into the dot: that form fails at run time
  ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
  Only the CPU branch uses it.
  """
  if (axes[0] == 0 and a.ndim == b.ndim == 2 and a.dtype == jnp.bfloat16
      and b.dtype == jnp.bfloat16):
    a3 = a.reshape(1, *a.shape)
    b3 = b.reshape(*b.shape[:axes[1]], 1, *b.shape[axes[1]:])
    return lax.optimization_barrier(lax.dot_general(
        a3, b3, (((0, 1), (axes[1], axes[1] + 1)), ((), ())),
        preferred_element_type=jnp.float32, **kwargs))
  return lax.dot_general(a, b, _dims(*axes),
                         preferred_element_type=jnp.float32, **kwargs)


def _wide(a, b, out_dtype, axes):
  """Unquantized operands: one dot with FP32 accumulation."""
  out = lax.dot_general(a, b, _dims(*axes), preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _cpu_wide(a, b, out_dtype, axes):
  """`_wide` on CPU: the dot as `_dot_f32` writes it (in `_wide`'s form a
  BF16 weight gradient of layers stacked by ``nnx.vmap`` fails at run
  time)."""
  return _dot_f32(a, b, axes).astype(out_dtype)


def _cpu_fp8(a, b, out_dtype, axes):
  """CPU per-tensor / row-wise: XLA's CPU dot upcasts FP8 operands to FP32
  and runs an FP32 GEMM; BF16 holds every FP8 value exactly and its dot with
  FP32 accumulation runs at about twice the speed. The product of the two
  scales is applied once, as the GPU forms do: one scale after the other
  overflows to Inf near the FP32 range."""
  pa, pb = a.payload.astype(jnp.bfloat16), b.payload.astype(jnp.bfloat16)
  # A transpose of an operand before its (elementwise) quantization would
  # otherwise fold into this dot as a BF16 dot contracting the lhs's first
  # axis, which fails at run time (see `_dot_f32`).
  pa, pb = lax.optimization_barrier((pa, pb))
  out = _dot_f32(pa, pb, axes)
  sa, sb = _outer_scales(a, b)
  return (out * (sa * sb)).astype(out_dtype)


def _fp8_folded(a, b, out_dtype, axes):
  """Per-tensor FP8 in the form XLA's GPU GEMM rewriter folds completely.

  ``dot(fp8, fp8, preferred_element_type=out) * (sa * sb)``: cuBLASLt gets
  the FP32 scale product as its scale operand and writes ``out`` directly;
  Triton multiplies in its epilogue. A BF16 output is multiplied by the
  product rounded to BF16, as the HLO says (exact for power-of-two scales),
  except where XLA keeps excess precision (``xla_allow_excess_precision``,
  on by default) and hands cuBLASLt the FP32 product instead: 4 of the 14
  BF16-output GEMMs of the Llama-3-8B block in the optimized HLO for sm_90
  and sm_100. Under XLA's CPU semantics the form rounds twice (accumulator
  to BF16, then the product), which differs from cuBLASLt's single
  rounding by at most about one BF16 ulp; the CPU branch does not use this
  form. Other forms
  (``(dot_f32 * sa * sb).astype(bf16)``, dequantized operands) leave an FP32
  output and an extra pass (benchmarks/RESULTS.md, "Deviceless GPU
  compilation").
  """
  s = a.scale * b.scale
  dims = _dims(*axes)
  pa, pb = _unmerged(a, b)
  if jnp.dtype(out_dtype) == jnp.float32:
    return lax.dot_general(pa, pb, dims,
                           preferred_element_type=jnp.float32) * s
  out = lax.dot_general(pa, pb, dims, preferred_element_type=out_dtype)
  return out * s.astype(out_dtype)


def _unmerged(a: QTensor, b: QTensor):
  """The two payloads through one optimization barrier per GEMM.

  XLA:GPU merges dots that share an operand (its DotMerger: the q/k/v
  projections of one input, gate/up) into one GEMM. Each of ours has its own
  output scales, so a merged GEMM writes FP32 or unscaled BF16 and the
  scales take extra passes over its output (benchmarks/RESULTS.md,
  "Deviceless GPU compilation", block program). Behind the barrier the
  operands are distinct values and every GEMM keeps its scales; it moves no
  data.
  """
  return lax.optimization_barrier((a.payload, b.payload))


def _fp8_rowwise(a, b, out_dtype, axes):
  """Row-wise FP8 on a GPU without the native kernel: XLA passes no vector
  scale to cuBLASLt, so the GEMM writes ``out_dtype`` (BF16 for Fprop/Dgrad,
  which halves the bytes of the pass the scales then take) and the scales
  follow. Exact for power-of-two row scales; otherwise the accumulator is
  rounded to ``out_dtype`` before the scales (one extra rounding)."""
  sa, sb = _outer_scales(a, b)
  dims = _dims(*axes)
  pa, pb = _unmerged(a, b)
  if jnp.dtype(out_dtype) == jnp.float32:
    out = lax.dot_general(pa, pb, dims, preferred_element_type=jnp.float32)
    return out * sa * sb
  out = lax.dot_general(pa, pb, dims, preferred_element_type=out_dtype)
  return out * (sa * sb).astype(out_dtype)


_FNUZ = {"e4m3": jnp.float8_e4m3fnuz, "e5m2": jnp.float8_e5m2fnuz}


def to_fnuz(q: QTensor) -> QTensor:
  """The same values in gfx942's FP8 types (MI300 has no OCP FP8): each
  E4M3/E5M2 payload value halved into E4M3FNUZ/E5M2FNUZ, whose exponent
  bias is one more (exact: all values, the sign of zero aside), and the
  scale doubled (exact). FNUZ operands pass unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers.scaling import QuantSpec, quantize
    >>> q = to_fnuz(quantize(jnp.array([[448.0, -1.0]]), QuantSpec(), 1))
    >>> q.format, q.payload.dtype, q.dequantize().tolist()
    ('e4m3fnuz', dtype(float8_e4m3fnuz), [[448.0, -1.0]])
  """
  if q.format not in _FNUZ:
    return q
  payload = (q.payload.astype(jnp.float32) * 0.5).astype(_FNUZ[q.format])
  return dataclasses.replace(q, payload=payload, scale=q.scale * 2,
                             format=q.format + "fnuz")


def _fnuz(form: Callable) -> Callable:
  """``form`` on FNUZ copies of FP8 operands (`to_fnuz`): gfx942."""
  return lambda a, b, out_dtype, axes: form(to_fnuz(a), to_fnuz(b),
                                            out_dtype, axes)


def _cpu_mx(a, b, out_dtype, axes):
  """CPU MX: an MX value (at most 4 significant bits times a power of two)
  is exact in BF16, which has FP32's exponent range: exact BF16 copies and
  XLA's BF16 dot with FP32 accumulation, written as `_dot_f32` writes it.
  """
  ad, bd = a.dequantize(jnp.bfloat16), b.dequantize(jnp.bfloat16)
  return _dot_f32(ad, bd, axes, precision=lax.Precision.HIGHEST
                  ).astype(out_dtype)


def _f32_emulation(a, b, out_dtype, axes):
  """CPU reference for arbitrary scales: FP32 dequantize, FP32 dot."""
  ad, bd = a.dequantize(jnp.float32), b.dequantize(jnp.float32)
  return _dot_f32(ad, bd, axes, precision=lax.Precision.HIGHEST
                  ).astype(out_dtype)


def _bf16_dequant(a, b, out_dtype, axes):
  """GPU MX without MX tensor cores: exact BF16 dequantize (XLA fuses it
  with the quantize that made the payload) and a BF16 dot that writes
  ``out_dtype`` directly."""
  ad, bd = a.dequantize(jnp.bfloat16), b.dequantize(jnp.bfloat16)
  pet = jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else out_dtype
  return lax.dot_general(ad, bd, _dims(*axes),
                         preferred_element_type=pet).astype(out_dtype)


def _f32_dequant(a, b, out_dtype, axes):
  """GPU tiles/blocks without a native kernel: FP32 dequantize and a dot at
  default precision, which XLA runs in TF32 on NVIDIA GPUs (operands rounded
  to 10 mantissa bits, below FP8's own 3; not bit-equal to the CPU's FP32)."""
  ad, bd = a.dequantize(jnp.float32), b.dequantize(jnp.float32)
  return lax.dot_general(ad, bd, _dims(*axes),
                         preferred_element_type=jnp.float32).astype(out_dtype)


def contraction_last(q: QTensor) -> QTensor:
  """The same quantized values laid out ``(free, K)``: a transpose of the
  payload and scales, relabelled (no requantization)."""
  if q.axis == 1:
    return q
  return dataclasses.replace(
      q, payload=q.payload.T, scale=q.scale if q.scale.ndim < 2 else q.scale.T,
      block=None if q.block is None else tuple(reversed(q.block)), axis=1,
      shape=tuple(reversed(q.shape)), transposed=not q.transposed,
      block_scale=None if q.block_scale is None else q.block_scale.T)


def _mx_cudnn(a, b, out_dtype, axes):
  """MX on sm_100: XLA's block-scaled dot (`qlayers.block_scaled_dot`, no
  global scale) of 3-D contraction-last operands with E8M0 scales, which
  XLA lowers to cuDNN's block-scaled GEMM (with Triton GEMMs on or off;
  ``lax.scaled_dot`` fails with them off). FP6/FP4 payloads are widened to
  E4M3 first (`qlayers.scaling.widened`, unless the operand was made so):
  the pinned XLA sends no MXFP4 to cuDNN and cannot compile FP6 operands."""
  del axes
  qa, qb = (scaling.widened(contraction_last(q)) for q in (a, b))
  e8m0 = lambda q: lax.bitcast_convert_type(q.scale, jnp.float8_e8m0fnu)[None]  # noqa: E731
  pet = (out_dtype if jnp.dtype(out_dtype) in (jnp.bfloat16, jnp.float16)
         else jnp.float32)
  out = block_scaled_dot(qa.payload[None], qb.payload[None], e8m0(qa),
                         e8m0(qb), None, pet)[0]
  return out[:a.shape[1 - a.axis], :b.shape[1 - b.axis]].astype(out_dtype)


def as_mx(q: QTensor) -> QTensor:
  """A tile/block FP8 operand whose scales are powers of two, as the MX
  operand of the same values: contraction-last, the same payload, and each
  scale's E8M0 code (its FP32 exponent field; NaN gives 0xFF) repeated for
  every 32 elements of its tile along K and every row of its block.
  ``as_mx(q).dequantize()`` is ``contraction_last(q).dequantize()`` bit for
  bit; the payload keeps its padding (K to whole tiles).

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers.scaling import QuantSpec, quantize
    >>> spec = QuantSpec(granularity="block", scale_rule="deepseek", pow2=True)
    >>> m = as_mx(quantize(jnp.ones((128, 8)), spec, 0))
    >>> m.granularity, m.payload.shape, m.scale.shape, int(m.scale[0, 0])
    ('mx', (128, 128), (128, 4), 119)
  """
  if q.granularity not in ("tile", "block") or q.fmt.bits != 8:
    raise ValueError(f"as_mx takes FP8 tile/block operands, got "
                     f"{q.granularity} {q.format}.")
  q = contraction_last(q)
  rows, cols = q.block
  if cols % 32:
    raise ValueError(f"as_mx needs tiles/blocks of whole 32-element MX blocks "
                     f"along K, got {q.block}.")
  bits = lax.bitcast_convert_type(q.scale.astype(jnp.float32), jnp.uint32)
  codes = ((bits >> 23) & 0xFF).astype(jnp.uint8)
  codes = jnp.repeat(jnp.repeat(codes, rows, axis=0), cols // 32, axis=1)
  return dataclasses.replace(q, scale=codes[:q.payload.shape[0]],
                             granularity="mx", block=(1, 32))


def _ue8m0_cudnn(a, b, out_dtype, axes):
  """DeepSeek-V3 tiles/blocks with power-of-two scales on sm_100: as MXFP8
  operands (`as_mx`) of cuDNN's block-scaled GEMM."""
  del axes
  return _mx_cudnn(as_mx(a), as_mx(b), out_dtype, (1, 1))


def as_nvfp4(q: QTensor) -> QTensor:
  """An E2M1 operand (NVFP4, or MXFP4) as the operand of cuDNN's NVFP4 GEMM:
  contraction-last, the same packed payload, E4M3 scales per 1 x 16
  (``block_scale``) under one FP32 ``tensor_scale``, and ``scale`` their
  FP32 product (for `QTensor.dequantize`).

  NVFP4 keeps its own two levels; a 16 x 16 weight block's scale is repeated
  for each of its rows. An MXFP4 block of 32 with E8M0 scale ``2**k`` is two
  NVFP4 blocks of E4M3 scale ``2**(k - c)`` under ``tensor_scale = 2**c``,
  ``c`` = the largest finite ``k`` - 8 (256 = 2**8 is the largest E4M3
  power of two). Exact for every block with ``k`` >= that ``k`` - 17 (E4M3
  reaches down to 2**-9); a block further below, whose largest value is
  under 2**-17 of the tensor's amax, gets scale 0: it is flushed to zero
  (a block of zeros, E8M0 2**-127, among them, exactly). An Inf/NaN block
  (0xFF) gets the E4M3 NaN. ``as_nvfp4(q).dequantize()`` is
  ``contraction_last(q).dequantize()`` bit for bit, but for flushed blocks.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers.scaling import QuantSpec, quantize
    >>> q = as_nvfp4(quantize(jnp.ones((2, 64)),
    ...                       QuantSpec(format="e2m1", granularity="mx")))
    >>> q.block_scale.shape, q.block_scale.dtype, q.tensor_scale.item()
    ((2, 4), dtype(float8_e4m3fn), 0.0009765625)
  """
  if q.format != "e2m1" or q.granularity not in ("tile", "block", "mx") or (
      q.granularity != "mx" and q.block_scale is None):
    raise ValueError(f"as_nvfp4 takes E2M1 NVFP4 operands (with their "
                     f"block_scale and tensor_scale) or MXFP4 ones, got "
                     f"{q.granularity} {q.format}.")
  q = contraction_last(q)
  rows = q.payload.shape[0]
  if q.granularity == "mx":
    codes = q.scale.astype(jnp.int32)
    top = jnp.max(jnp.where(codes == 255, 0, codes))
    e = codes - top + 8  # log2 of the E4M3 scale: 2**k / 2**c
    pow2 = lambda n: lax.bitcast_convert_type(  # noqa: E731  2**n, normal n
        ((n + 127) << 23).astype(jnp.uint32), jnp.float32)
    e4m3 = jnp.where(e >= -9, pow2(jnp.clip(e, -9, 8)), 0.0)
    e4m3 = jnp.repeat(jnp.where(codes == 255, jnp.nan, e4m3), 2, axis=1)
    c = top - 135  # 2**c in two normal factors (c may be below -126)
    tensor_scale = pow2(c // 2) * pow2(c - c // 2)
    block_scale = e4m3.astype(jnp.float8_e4m3fn)
  else:
    tensor_scale = q.tensor_scale
    block_scale = jnp.repeat(q.block_scale, q.block[0], axis=0)[:rows]
  scale = block_scale.astype(jnp.float32) * tensor_scale
  return dataclasses.replace(q, scale=scale, granularity="tile",
                             block=(1, 16), block_scale=block_scale,
                             tensor_scale=tensor_scale)


def _e2m1(q: QTensor) -> jax.Array:
  """The packed E2M1 payload as a ``float4_e2m1fn`` array (low nibble first,
  as `formats.pack` writes it): a bitcast, no data moves."""
  return lax.bitcast_convert_type(q.payload, jnp.float4_e2m1fn).reshape(
      q.payload.shape[0], -1)


def _nvfp4_cudnn(a, b, out_dtype, axes):
  """E2M1 x E2M1 on sm_100 (NVFP4; MXFP4 as NVFP4, `as_nvfp4`): cuDNN's
  NVFP4 block-scaled GEMM of the ``float4_e2m1fn`` payloads with E4M3
  scales per 16, the per-tensor scales' product passed into it as its
  global scale (`qlayers.block_scaled_dot`), so it writes ``out_dtype``
  directly. That scale has the output's type (XLA requires it): a BF16
  output is scaled by the product rounded to BF16 (within 2**-8 of the
  FP32 product: one factor on the whole output); exact for MXFP4, whose
  per-tensor scales are powers of two, and for an FP32 output."""
  del axes
  qa, qb = as_nvfp4(a), as_nvfp4(b)
  out = block_scaled_dot(_e2m1(qa)[None], _e2m1(qb)[None],
                         qa.block_scale[None], qb.block_scale[None],
                         qa.tensor_scale * qb.tensor_scale, out_dtype)[0]
  return out[:a.shape[1 - a.axis], :b.shape[1 - b.axis]]


def _ue8m0_scaled_dot(a, b, out_dtype, axes):
  """The same on gfx950: MXFP8 operands of ``lax.scaled_dot``."""
  del axes
  out = scaled_dot_mx(as_mx(a), as_mx(b), out_dtype)
  return out[:a.shape[1 - a.axis], :b.shape[1 - b.axis]]


def scaled_dot_mx(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """MX FP8 GEMM through ``lax.scaled_dot`` (payloads + E8M0 scale arrays).

  The ROCm gfx950 form (hipBLASLt MX). On NVIDIA GPUs it becomes a Triton
  kernel that fails to compile with Triton GEMMs off, so CUDA never uses it.
  It has no transpose rule, which is fine: it only ever runs inside our own
  custom_vjp.
  """
  def e8m0(q):
    return lax.bitcast_convert_type(q.scale, jnp.float8_e8m0fnu)
  out = lax.scaled_dot(a.payload, b.payload, lhs_scale=e8m0(a),
                       rhs_scale=e8m0(b),
                       dimension_numbers=_dims(a.axis, b.axis),
                       preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _ffi(a, b, out_dtype, axes):
  """The native kernel (TN operands; the transposes are XLA's)."""
  del axes
  from qlayers import _native  # pylint: disable=g-import-not-at-top
  return _native.gemm(contraction_last(a), contraction_last(b),
                      out_dtype=out_dtype)


FORMS: dict[str, Callable] = {
    "wide": _wide,
    "cpu_wide": _cpu_wide,
    "cpu_fp8": _cpu_fp8,
    "cpu_mx": _cpu_mx,
    "f32_emulation": _f32_emulation,
    "fp8_folded": _fp8_folded,
    "fp8_rowwise": _fp8_rowwise,
    "fp8_fnuz_folded": _fnuz(_fp8_folded),
    "fp8_fnuz_rowwise": _fnuz(_fp8_rowwise),
    "bf16_dequant": _bf16_dequant,
    "f32_dequant": _f32_dequant,
    "mx_cudnn": _mx_cudnn,
    "ue8m0_cudnn": _ue8m0_cudnn,
    "nvfp4_cudnn": _nvfp4_cudnn,
    "ue8m0_scaled_dot": _ue8m0_scaled_dot,
    "scaled_dot": lambda a, b, out_dtype, axes: scaled_dot_mx(a, b, out_dtype),
    "ffi": _ffi,
}

