"""GEMM dispatch: which backend runs a quantized GEMM, chosen in one place.

Every backend takes the same contract: two operands, each a `QTensor`
(payload + scales + layout) or a plain wide array, contracted over their
``axis``, and returns the wide product with FP32 accumulation.

* ``xla``: plain JAX. Per-tensor and row-wise FP8 run as an FP8
  ``dot_general`` with ``preferred_element_type=float32`` and the scales
  applied to the output; on GPUs XLA rewrites this pattern into the vendor
  FP8 GEMM (cuBLASLt / hipBLASLt). Block-scaled formats (tiles, blocks, MX) are
  emulated: dequantize to FP32, then one FP32 dot. The emulation is the
  numerical reference for every other backend.
* ``ffi``: native kernels from ``ffi/`` through XLA FFI (see `qlayers._native`).

``QLAYERS_BACKEND=xla|ffi`` (or the ``backend=`` argument) forces a backend.

Under a mesh with auto axes, quantized GEMMs run through `qlayers.partition`
(each device its local GEMM; FSDP weights gathered as payloads): always for
``ffi``, and for ``xla`` unless ``QLAYERS_QUANTIZED_GATHER=0`` (see
`qlayers.sharding`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import partition
from qlayers import sharding
from qlayers.scaling import QTensor

__all__ = ["gemm", "select", "report", "BACKENDS"]

BACKENDS = ("xla", "ffi")


def _native():
  try:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return _native


def _ffi_supports(a, b) -> tuple[bool, str]:
  native = _native()
  if native is None or not hasattr(native, "supports") or not native.available():
    why = native.unavailable_reason() if native else "qlayers._native missing"
    return False, f"native library not available ({why})"
  return native.supports(a, b)


def select(a, b, backend: str | None = None,
           platform: str | None = None) -> tuple[str, str]:
  """Chooses the backend for a GEMM of ``a`` and ``b``: ``(name, reason)``."""
  requested = backend or os.environ.get("QLAYERS_BACKEND") or None
  if requested is not None and requested not in BACKENDS:
    raise ValueError(f"Unknown backend {requested!r}; expected one of "
                     f"{BACKENDS} (from the backend argument or "
                     "QLAYERS_BACKEND).")
  quantized = isinstance(a, QTensor)
  if not quantized:
    return "xla", "unquantized operands"
  if requested == "xla":
    return "xla", "forced"
  ok, why = _ffi_supports(a, b)
  if requested == "ffi":
    if not ok:
      raise ValueError(f"backend 'ffi' was forced but cannot run this GEMM: "
                       f"{why}.")
    return "ffi", "forced"
  platform = platform or jax.default_backend()
  if a.granularity in ("tensor", "row") and platform != "cpu":
    return "xla", "XLA rewrites scaled FP8 dot_general to the vendor GEMM"
  if platform == "cpu" and {a.granularity, b.granularity} & {"tile", "block"}:
    return "xla", ("FP32 emulation (arbitrary FP32 tile/block scales): about "
                   "as fast as the native kernel on CPU")
  if platform == "cpu":
    # Measured (benchmarks/RESULTS.md, gemm.py and step.py): XLA's BF16 dot
    # with FP32 accumulation on exact BF16 copies of the operands (FP8
    # payloads; MX blocks dequantized) beats the native kernel, which
    # decodes to FP32 and runs an FP32 GEMM, for FP8 and packed FP6/FP4.
    return "xla", ("exact BF16 operands + XLA's BF16 dot (FP32 accumulation)"
                   " is fastest on CPU")
  return "xla", "default"


def prefers_contraction_last(granularity: str,
                             backend: str | None = None) -> bool:
  """Whether operands of this granularity should be quantized contraction-last
  (TN layout), because the backend that will run them needs it."""
  requested = backend or os.environ.get("QLAYERS_BACKEND") or None
  if requested == "xla":
    return False
  native = _native()
  if native is None or not hasattr(native, "supports") or not native.available():
    return False
  # By default only packed formats (always contraction-last) go native.
  return requested == "ffi"


def _scale_vector(q: QTensor) -> jax.Array:
  """Row-wise scales of a 2-D operand as a vector over its free dim."""
  if q.granularity == "tensor":
    return q.scale
  return jnp.squeeze(q.scale, axis=q.axis)


def _dims(a_axis: int, b_axis: int):
  return (((a_axis,), (b_axis,)), ((), ()))


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
  """
  if (axes[0] == 0 and a.ndim == b.ndim == 2 and a.dtype == jnp.bfloat16
      and b.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"):
    a3 = a.reshape(1, *a.shape)
    b3 = b.reshape(*b.shape[:axes[1]], 1, *b.shape[axes[1]:])
    return lax.optimization_barrier(lax.dot_general(
        a3, b3, (((0, 1), (axes[1], axes[1] + 1)), ((), ())),
        preferred_element_type=jnp.float32, **kwargs))
  return lax.dot_general(a, b, _dims(*axes),
                         preferred_element_type=jnp.float32, **kwargs)


def scaled_dot_mx(a: QTensor, b: QTensor, out_dtype) -> jax.Array:
  """MX FP8 GEMM through ``lax.scaled_dot`` (payloads + E8M0 scale arrays).

  XLA lowers it to cuDNN block-scaled GEMMs on Blackwell and hipBLASLt on
  gfx950; elsewhere it dequantizes first. It has no transpose rule, which is
  fine: it only ever runs inside our own custom_vjp.
  """
  def e8m0(q):
    return lax.bitcast_convert_type(q.scale, jnp.float8_e8m0fnu)
  out = lax.scaled_dot(a.payload, b.payload, lhs_scale=e8m0(a),
                       rhs_scale=e8m0(b),
                       dimension_numbers=_dims(a.axis, b.axis),
                       preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def xla_gemm(a, b, out_dtype, axes: tuple[int, int], *,
             use_scaled_dot: bool = False) -> jax.Array:
  """The ``xla`` backend (see module docstring)."""
  dims = _dims(*axes)
  if not isinstance(a, QTensor):
    out = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)
  cpu = jax.default_backend() == "cpu"
  if a.granularity in ("tensor", "row") and b.granularity in ("tensor", "row"):
    pa, pb = a.payload, b.payload
    if cpu:
      # XLA's CPU dot upcasts FP8 operands to FP32 and runs an FP32 GEMM;
      # BF16 holds every FP8 value exactly and its dot with FP32
      # accumulation runs at about twice the speed. (Elsewhere the FP8 dot
      # is the pattern XLA rewrites to the vendor FP8 GEMM: keep it.)
      pa, pb = pa.astype(jnp.bfloat16), pb.astype(jnp.bfloat16)
    out = _dot_f32(pa, pb, axes)
    sa, sb = _scale_vector(a), _scale_vector(b)
    if sa.ndim:
      sa = sa[:, None]
    if sb.ndim:
      sb = sb[None, :]
    return (out * sa * sb).astype(out_dtype)
  if (use_scaled_dot and a.granularity == b.granularity == "mx"
      and not (a.fmt.packed or b.fmt.packed)):
    return scaled_dot_mx(a, b, out_dtype)
  # Emulation: dequantize, then one dot with FP32 accumulation. An MX value
  # (element of at most 4 significant bits times a power of two) is exact in
  # BF16, which has FP32's exponent range, so on CPU MX operands dequantize
  # to BF16 and take the BF16 dot; tiles/blocks have arbitrary FP32 scales.
  wide = jnp.float32
  if cpu and a.granularity == b.granularity == "mx":
    wide = jnp.bfloat16
  ad = a.dequantize(wide)
  bd = b.dequantize(wide)
  out = _dot_f32(ad, bd, axes, precision=lax.Precision.HIGHEST)
  return out.astype(out_dtype)


def gemm(a, b, *, axes: tuple[int, int], out_dtype,
         backend: str | None = None) -> jax.Array:
  """Product of two 2-D operands contracted over ``axes`` (one per operand).

  ``a`` and ``b`` are both `QTensor` (quantized along their contraction axis)
  or both plain arrays. The result has shape ``(free dim of a, free dim of
  b)`` and dtype ``out_dtype``; accumulation is FP32.
  """
  if isinstance(a, QTensor) != isinstance(b, QTensor):
    raise TypeError("gemm operands must both be QTensor or both be arrays.")
  if isinstance(a, QTensor) and (a.axis, b.axis) != tuple(axes):
    raise ValueError(f"operands were quantized along axes {(a.axis, b.axis)}"
                     f" but the GEMM contracts {tuple(axes)}.")
  name, _ = select(a, b, backend)
  if (isinstance(a, QTensor) and sharding.auto_mesh() is not None
      and not sharding.unpartitioned_now()
      and (name == "ffi" or sharding.quantized_gather())):
    return partition.gemm(a, b, axes, out_dtype, name)
  return _LOCAL[name](a, b, tuple(axes), out_dtype)


def _use_scaled_dot() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


_LOCAL = {
    "xla": lambda a, b, axes, out_dtype: xla_gemm(
        a, b, out_dtype, axes, use_scaled_dot=_use_scaled_dot()),
    "ffi": lambda a, b, axes, out_dtype: _native().gemm(
        a, b, out_dtype=out_dtype),
}
for _name, _fn in _LOCAL.items():
  partition.register_local(_name, _fn)


def _choice_for(recipe) -> tuple[str, str]:
  """Backend and reason for a recipe's Fprop on a 256x256x256 GEMM."""
  from qlayers import scaling  # pylint: disable=g-import-not-at-top
  g = recipe.fprop
  if g.lhs is None:
    return "xla", "unquantized"
  last_b = g.rhs.fmt.packed or prefers_contraction_last(g.rhs.granularity)
  def q(spec, axis):
    return jax.eval_shape(
        lambda: scaling.quantize(jnp.zeros((256, 256)), spec, axis))
  try:
    return select(q(g.lhs, 1), q(g.rhs, 1 if last_b else 0))
  except ValueError as e:  # a forced backend that cannot run it
    return "error", str(e)


def report() -> dict:
  """What is available, and which backend each named recipe's GEMMs use here.

  Example:
    >>> import qlayers
    >>> info = qlayers.backends()
    >>> sorted(info)
    ['available', 'chosen', 'ffi_build', 'forced', 'platform']
  """
  from qlayers.recipe import available_recipes, recipe as load  # pylint: disable=g-import-not-at-top
  native = _native()
  ffi_ok = bool(native and hasattr(native, "available") and native.available())
  chosen = {}
  for name in available_recipes():
    backend, why = _choice_for(load(name))
    chosen[name] = {"backend": backend, "why": why}
  return {
      "platform": jax.default_backend(),
      "available": {"xla": True, "ffi": ffi_ok},
      "ffi_build": native.build_info() if ffi_ok else (
          native.unavailable_reason() if native else
          "qlayers._native missing"),
      "forced": os.environ.get("QLAYERS_BACKEND"),
      "chosen": chosen,
  }
