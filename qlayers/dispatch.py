"""GEMM dispatch: which backend and code form runs a quantized GEMM, per platform.

Every backend takes the same contract: two operands, each a `QTensor`
(payload + scales + layout) or a plain wide array, contracted over their
``axis``, and returns the wide product with FP32 accumulation.

* ``xla``: plain JAX, in the form XLA turns into the best kernel it has on
  the platform (a *form* is one way of writing the GEMM, see `FORMS`).
* ``ffi``: native kernels from ``ffi/`` through XLA FFI (see `qlayers._native`).

The choice is made for the platform the program is *lowered* for, not the
host's ``jax.default_backend()``: `gemm` traces one branch per distinct
choice and hands them to ``lax.platform_dependent``, which compiles only the
branch of the lowering platform (cpu, cuda or rocm); where no GPU can be the
target (`targets_gpu`) it traces the CPU branch alone. The CPU branch is the
numerical reference; the others only change how the same product is
computed. `TABLE` holds every rule, first match wins:
(platform, architecture, granularity, element format) -> (backend, form, why).

What a platform branch cannot see is the GPU *generation* (sm_90 and sm_100
lower the same way), so it comes from `gpu_arch`: the `target_arch` context
manager (part of jax's cache keys), else ``$QLAYERS_GPU_ARCH`` (``sm_90``,
``sm_100``, ``gfx942``, ``gfx950``; set it before the first trace), else the
compute capability of the GPUs jax sees.

``QLAYERS_BACKEND=xla|ffi`` (or the ``backend=`` argument) forces a backend.

Under a mesh with auto axes, quantized GEMMs run through `qlayers.partition`
(each device its local GEMM; FSDP weights gathered as payloads): always for
``ffi``, and for ``xla`` unless ``QLAYERS_QUANTIZED_GATHER=0`` (see
`qlayers.sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import native_quantize
from qlayers import partition
from qlayers import sharding
from qlayers.scaling import QTensor

__all__ = ["gemm", "select", "choose", "report", "target_arch", "gpu_arch",
           "TABLE", "FORMS", "BACKENDS", "PLATFORMS"]

BACKENDS = ("xla", "ffi")
# Platforms `gemm` compiles a branch for ("tpu" takes the generic rules).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _native():
  try:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return _native


# ----------------------------------------------------------------------------
# The GPU generation being compiled for

_ARCH = re.compile(r"^(sm_\d+|gfx\d+[a-z]?)$")
# Part of jax's tracing and compilation cache keys: a function traced for one
# target is traced again for another.
_TARGET = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def target_arch(arch: str) -> Iterator[None]:
  """GEMMs traced inside are chosen for GPU ``arch`` (``"sm_90"``, ``"sm_100"``,
  ``"gfx942"``, ``"gfx950"``): for compiling for a GPU that is not attached.
  The target is part of jax's cache keys, so jitted functions retrace.

  Example:
    >>> with target_arch("sm_100"):
    ...   gpu_arch("cuda")
    'sm_100'
  """
  if not _ARCH.match(arch):
    raise ValueError(f"Unknown GPU architecture {arch!r}; expected e.g. "
                     "'sm_90', 'sm_100', 'gfx942' or 'gfx950'.")
  with _TARGET(arch):
    yield


def targets_gpu() -> bool:
  """Whether GEMMs traced now may be lowered for a GPU: the host has one,
  or a GPU target is named (`target_arch`, ``$QLAYERS_GPU_ARCH``)."""
  return (jax.default_backend() != "cpu" or bool(_TARGET.value)
          or bool(os.environ.get("QLAYERS_GPU_ARCH", "").strip()))


def _arch_platform(arch: str) -> str:
  return "cuda" if arch.startswith("sm_") else "rocm"


@functools.lru_cache(maxsize=None)
def _device_arch(platform: str) -> str | None:
  """Architecture of the first ``platform`` device jax sees, or None."""
  try:
    devices = jax.devices(platform)
  except (RuntimeError, ValueError):
    return None
  if not devices:
    return None
  cc = str(getattr(devices[0], "compute_capability", "") or "")
  if platform == "cuda":
    m = re.match(r"^(\d+)\.(\d+)", cc)
    return f"sm_{m.group(1)}{m.group(2)}" if m else None
  m = re.search(r"gfx\d+[a-z]?", cc or str(devices[0].device_kind))
  return m.group(0) if m else None


def gpu_arch(platform: str) -> str | None:
  """The GPU architecture GEMMs for ``platform`` are chosen for, or None.

  `target_arch` first, then ``$QLAYERS_GPU_ARCH`` (read when a GEMM is
  traced; set it before the first one), then the devices jax sees.
  """
  if platform not in ("cuda", "rocm"):
    return None
  env = os.environ.get("QLAYERS_GPU_ARCH", "").strip()
  for arch in (_TARGET.value, env):
    if not arch:
      continue
    if not _ARCH.match(arch):
      raise ValueError(f"QLAYERS_GPU_ARCH={arch!r} is not a GPU architecture"
                       " (e.g. sm_90, sm_100, gfx942, gfx950).")
    if _arch_platform(arch) == platform:
      return arch
  return _device_arch(platform)


def _sm(arch: str | None) -> int:
  """``sm_90`` -> 90 (0 when unknown or not CUDA)."""
  return int(arch[3:]) if arch and arch.startswith("sm_") else 0


def _active(platform: str) -> bool:
  """Whether a program may really be lowered for ``platform`` here: the host,
  or a GPU that is attached or named as the target."""
  return platform == "cpu" or gpu_arch(platform) is not None


# ----------------------------------------------------------------------------
# The table


def _kind(q: QTensor) -> str:
  """``fp8`` / ``fp6`` / ``fp4`` by element width."""
  return {8: "fp8", 6: "fp6", 4: "fp4"}[q.fmt.bits]


def _granularity(a: QTensor, b: QTensor) -> str:
  """``tensor`` / ``row`` (row x row or row x tensor) / ``blockwise`` (tiles
  and blocks) / ``mx``, or ``mixed`` for any other pair."""
  ga, gb = ({"tile": "blockwise", "block": "blockwise"}.get(g, g)
            for g in (a.granularity, b.granularity))
  if {ga, gb} == {"tensor", "row"}:
    return "row"
  return ga if ga == gb else "mixed"


@dataclasses.dataclass(frozen=True)
class Rule:
  """One row of `TABLE`: where it applies and what it picks.

  ``arch`` is a predicate on the GPU architecture (None when unknown);
  ``granularity`` and ``kinds`` list what the operands may be (``kinds``:
  the element formats of both operands must be among them). An ``ffi`` row
  applies only when the native kernel supports the operands there.
  """

  platform: str  # "cpu" | "cuda" | "rocm" | "*"
  arch: str  # description of the predicate, for the report
  granularity: tuple[str, ...]
  kinds: tuple[str, ...]
  backend: str
  form: str
  why: str
  arch_ok: Callable[[str | None], bool] = dataclasses.field(
      default=lambda arch: True, compare=False, repr=False)

  def matches(self, platform, arch, granularity, kinds) -> bool:
    return (self.platform in (platform, "*") and self.arch_ok(arch)
            and granularity in self.granularity
            and set(kinds) <= set(self.kinds))


_ANY = ("fp8", "fp6", "fp4")
_HOPPER = lambda arch: 90 <= _sm(arch) < 100  # noqa: E731
_MX_CORES = lambda arch: _sm(arch) >= 100  # noqa: E731
_GFX950 = lambda arch: arch == "gfx950"  # noqa: E731

TABLE: tuple[Rule, ...] = (
    # --- CPU: the numerical reference (benchmarks/RESULTS.md for speed).
    Rule("cpu", "any", ("tensor", "row"), ("fp8",), "xla", "cpu_fp8",
         "exact BF16 copies of the FP8 payloads + XLA's BF16 dot (FP32 "
         "accumulation): about twice XLA's FP8 dot, which upcasts to FP32"),
    Rule("cpu", "any", ("blockwise", "mixed"), _ANY, "xla", "f32_emulation",
         "FP32 emulation (arbitrary FP32 tile/block scales): about as fast "
         "as the native kernel on CPU"),
    Rule("cpu", "any", ("mx",), _ANY, "xla", "cpu_mx",
         "exact BF16 dequantize (a native pass per operand where it "
         "applies) + XLA's BF16 dot (FP32 accumulation) beats the native "
         "MX GEMM on CPU"),
    # --- NVIDIA.
    Rule("cuda", "any", ("tensor",), ("fp8",), "xla", "fp8_folded",
         "FP8 dot_general with both scales folded into cuBLASLt FP8 (or the "
         "Triton FP8 epilogue), output written in its final dtype",),
    Rule("cuda", "sm_90", ("row",), ("fp8",), "ffi", "ffi",
         "cuBLASLt OUTER_VEC_32F row-wise FP8 (sm_90, cuBLAS >= 12.9): the "
         "only route that folds vector scales", arch_ok=_HOPPER),
    Rule("cuda", "any", ("row",), ("fp8",), "xla", "fp8_rowwise",
         "FP8 dot_general with BF16 output and the vector scales applied "
         "after it: XLA folds no vector scale into the GEMM"),
    Rule("cuda", "sm_90", ("blockwise",), ("fp8",), "ffi", "ffi",
         "cuBLASLt VEC128_32F / BLK128x128_32F block-scaled FP8 (sm_90, "
         "cuBLAS >= 12.9): XLA has no blockwise route", arch_ok=_HOPPER),
    Rule("cuda", "sm_100+", ("mx",), ("fp8",), "xla", "mx_cudnn",
         "jax.nn.scaled_matmul -> cuDNN block-scaled MXFP8 GEMM",
         arch_ok=_MX_CORES),
    # --- AMD (not compiled here: no ROCm toolchain on the build machine).
    Rule("rocm", "any", ("tensor",), ("fp8",), "xla", "fp8_folded",
         "FP8 dot_general with the scales on its output: XLA rewrites it to "
         "hipBLASLt FP8"),
    Rule("rocm", "any", ("row",), ("fp8",), "xla", "fp8_rowwise",
         "FP8 dot_general with BF16 output and the vector scales after it"),
    Rule("rocm", "gfx950", ("mx",), ("fp8",), "xla", "scaled_dot",
         "lax.scaled_dot -> hipBLASLt MX GEMM (gfx950, ROCm >= 7)",
         arch_ok=_GFX950),
    # Applies once libqlayers_rocm.so's MX handler takes FP6/FP4 payloads;
    # today's takes e4m3/e5m2 only (_native.supports says so), so MXFP6/MXFP4
    # fall to the BF16 dequantize below.
    Rule("rocm", "gfx950", ("mx",), ("fp6", "fp4"), "ffi", "ffi",
         "hipBLASLt MXFP6/MXFP4 through the native library (gfx950): XLA has "
         "no FP6/FP4 route", arch_ok=_GFX950),
    # --- Any other platform, and what is left on the GPUs.
    Rule("*", "any", ("tensor",), ("fp8",), "xla", "fp8_folded",
         "FP8 dot_general with both scales folded into its output"),
    Rule("*", "any", ("row",), ("fp8",), "xla", "fp8_rowwise",
         "FP8 dot_general with the vector scales after it"),
    Rule("*", "any", ("mx",), _ANY, "xla", "bf16_dequant",
         "exact BF16 dequantize (MX values are exact in BF16) + BF16 dot: "
         "no MX tensor cores, or no XLA route for this format"),
    Rule("*", "any", ("blockwise", "mixed"), _ANY, "xla", "f32_dequant",
         "FP32 dequantize (arbitrary FP32 scales are not exact in BF16) + "
         "dot at default precision (TF32 on NVIDIA GPUs)"),
)


@dataclasses.dataclass(frozen=True)
class Choice:
  """The backend and code form of one GEMM on one platform, and why."""

  backend: str
  form: str
  why: str


def _requested(backend: str | None) -> str | None:
  requested = backend or os.environ.get("QLAYERS_BACKEND") or None
  if requested is not None and requested not in BACKENDS:
    raise ValueError(f"Unknown backend {requested!r}; expected one of "
                     f"{BACKENDS} (from the backend argument or "
                     "QLAYERS_BACKEND).")
  return requested


@dataclasses.dataclass(frozen=True)
class _View:
  """Shapes and metadata of a `QTensor` as `_contraction_last` would lay it
  out, without tracing the transposes (what `_native.supports` reads)."""

  payload: jax.ShapeDtypeStruct
  scale: jax.ShapeDtypeStruct
  format: str
  granularity: str
  block: tuple[int, ...] | None
  axis: int
  shape: tuple[int, ...]

  @property
  def fmt(self):
    from qlayers import formats  # pylint: disable=g-import-not-at-top
    return formats.get_format(self.format)


def _tn_view(q: QTensor) -> _View:
  flip = q.axis != 1
  def shape(x, flip_it):
    return jax.ShapeDtypeStruct(tuple(reversed(x.shape)) if flip_it else
                                tuple(x.shape), x.dtype)
  return _View(shape(q.payload, flip), shape(q.scale, flip and q.scale.ndim == 2),
               q.format, q.granularity,
               None if q.block is None else
               (tuple(reversed(q.block)) if flip else q.block),
               1 if q.ndim == 2 else q.axis,
               tuple(reversed(q.shape)) if flip else q.shape)


def _ffi_supports(a, b, platform: str, arch: str | None) -> tuple[bool, str]:
  """Whether the native kernel takes ``a`` and ``b`` on ``platform`` once
  they are laid out contraction-last (the ffi form does that)."""
  native = _native()
  if native is None:
    return False, "qlayers._native missing"
  return native.supports(_tn_view(a), _tn_view(b), platform=platform,
                         arch=arch)


def choose(a, b, platform: str, arch: str | None = None, *,
           backend: str | None = None) -> Choice:
  """The `Choice` for a GEMM of ``a`` and ``b`` lowered for ``platform``.

  ``arch`` is the GPU architecture (see `gpu_arch`; None: unknown). A forced
  ``ffi`` that cannot run there raises ValueError on a platform this process
  may lower for (`_active`), and falls back to the table elsewhere.
  """
  requested = _requested(backend)
  if not isinstance(a, QTensor):
    return Choice("xla", "wide", "unquantized operands")
  where = platform + (f" {arch}" if arch else "")
  if requested == "ffi":
    ok, why = _ffi_supports(a, b, platform, arch)
    if ok:
      return Choice("ffi", "ffi", "forced")
    if platform == "cpu" or _active(platform):
      raise ValueError(f"backend 'ffi' was forced but cannot run this GEMM "
                       f"on {where}: {why}.")
  gran = _granularity(a, b)
  kinds = (_kind(a), _kind(b))
  for rule in TABLE:
    if not rule.matches(platform, arch, gran, kinds):
      continue
    if rule.backend == "ffi":
      if requested == "xla" or not _ffi_supports(a, b, platform, arch)[0]:
        continue
    if requested == "xla":
      return Choice("xla", rule.form, f"forced; {rule.why}")
    if requested == "ffi":
      return Choice("xla", rule.form, f"ffi forced but unavailable on "
                    f"{where}; {rule.why}")
    return Choice(rule.backend, rule.form, rule.why)
  raise ValueError(f"No dispatch rule for {a.granularity} x {b.granularity} "
                   f"{a.format} x {b.format} operands on {where}.")


def _host_platform() -> str:
  name = jax.default_backend()
  if name == "gpu":
    name = jax.devices()[0].platform
  return name


def select(a, b, backend: str | None = None,
           platform: str | None = None) -> tuple[str, str]:
  """``(backend, reason)`` for a GEMM of ``a`` and ``b`` on ``platform``
  (default: the host's jax backend)."""
  platform = platform or _host_platform()
  c = choose(a, b, platform, gpu_arch(platform), backend=backend)
  return c.backend, c.why


def prefers_contraction_last(granularity: str,
                             backend: str | None = None) -> bool:
  """Whether operands of this granularity should be quantized contraction-last
  (TN layout) before any platform branch: only when the native kernels are
  forced (they take TN operands on every platform) and exist for it. Where the
  table picks ``ffi`` by itself, the GPU branch transposes the payload."""
  if _requested(backend) != "ffi":
    return False
  native = _native()
  if native is None or not native.available():
    return False
  return granularity in native.NATIVE_GRANULARITIES


# ----------------------------------------------------------------------------
# The forms


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


def _cpu_fp8(a, b, out_dtype, axes):
  """CPU per-tensor / row-wise: XLA's CPU dot upcasts FP8 operands to FP32
  and runs an FP32 GEMM; BF16 holds every FP8 value exactly and its dot with
  FP32 accumulation runs at about twice the speed. The product of the two
  scales is applied once, as the GPU forms do: one scale after the other
  overflows to Inf near the FP32 range."""
  pa, pb = a.payload.astype(jnp.bfloat16), b.payload.astype(jnp.bfloat16)
  out = _dot_f32(pa, pb, axes)
  sa, sb = _outer_scales(a, b)
  return (out * (sa * sb)).astype(out_dtype)


def _fp8_folded(a, b, out_dtype, axes):
  """Per-tensor FP8 in the form XLA's GPU GEMM rewriter folds completely.

  ``dot(fp8, fp8, preferred_element_type=out) * (sa * sb)``: cuBLASLt gets
  the FP32 scale product as its scale operand and writes ``out`` directly;
  Triton multiplies in its epilogue. A BF16 output is multiplied by the
  product rounded to BF16, as the HLO says (exact for power-of-two scales).
  Under XLA's CPU semantics that rounds twice (accumulator to BF16, then
  the product), which differs from cuBLASLt's single rounding by at most
  about one BF16 ulp; the CPU branch does not use this form. Other forms
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


def _cpu_mx(a, b, out_dtype, axes, native: bool = True):
  """CPU MX: an MX value (at most 4 significant bits times a power of two)
  is exact in BF16, which has FP32's exponent range.

  Where `native_quantize.dequantizes` both operands (and ``native``), each
  is one native pass that writes the BF16 copy in the layout of a plain
  ``(M, K) @ (K, N)`` dot, transposing on the way where the contraction
  axis is elsewhere; the same bits as XLA's fusion, without a fusion per
  operand to compile.
  """
  if (native and native_quantize.dequantizes(a)
      and native_quantize.dequantizes(b)):
    ad = native_quantize.dequantize(a, transpose=axes[0] == 0, cpu_only=True)
    bd = native_quantize.dequantize(b, transpose=axes[1] == 1, cpu_only=True)
    return lax.dot_general(ad, bd, _dims(1, 0),
                           preferred_element_type=jnp.float32
                           ).astype(out_dtype)
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


def _contraction_last(q: QTensor) -> QTensor:
  """The same quantized values laid out ``(free, K)``: a transpose of the
  payload and scales, relabelled (no requantization)."""
  if q.axis == 1:
    return q
  return dataclasses.replace(
      q, payload=q.payload.T, scale=q.scale if q.scale.ndim < 2 else q.scale.T,
      block=None if q.block is None else tuple(reversed(q.block)), axis=1,
      shape=tuple(reversed(q.shape)), transposed=not q.transposed)


def _mx_cudnn(a, b, out_dtype, axes):
  """MXFP8 on sm_100: ``jax.nn.scaled_matmul`` on 3-D contraction-last
  operands with E8M0 scales, which XLA lowers to cuDNN's block-scaled GEMM
  (with Triton GEMMs on or off; ``lax.scaled_dot`` fails with them off)."""
  del axes
  qa, qb = _contraction_last(a), _contraction_last(b)
  e8m0 = lambda q: lax.bitcast_convert_type(q.scale, jnp.float8_e8m0fnu)[None]  # noqa: E731
  pet = jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else out_dtype
  out = jax.nn.scaled_matmul(qa.payload[None], qb.payload[None], e8m0(qa),
                             e8m0(qb), preferred_element_type=pet)[0]
  return out[:a.shape[1 - a.axis], :b.shape[1 - b.axis]].astype(out_dtype)


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
  return _native().gemm(_contraction_last(a), _contraction_last(b),
                        out_dtype=out_dtype)


FORMS: dict[str, Callable] = {
    "wide": _wide,
    "cpu_fp8": _cpu_fp8,
    "cpu_mx": _cpu_mx,
    "f32_emulation": _f32_emulation,
    "fp8_folded": _fp8_folded,
    "fp8_rowwise": _fp8_rowwise,
    "bf16_dequant": _bf16_dequant,
    "f32_dequant": _f32_dequant,
    "mx_cudnn": _mx_cudnn,
    "scaled_dot": lambda a, b, out_dtype, axes: scaled_dot_mx(a, b, out_dtype),
    "ffi": _ffi,
}


def _form(name: str, backend: str | None) -> Callable:
  """`FORMS` entry ``name``; with the ``xla`` backend forced, XLA ops only
  (no native dequantize in ``cpu_mx``)."""
  if name == "cpu_mx" and backend == "xla":
    return functools.partial(_cpu_mx, native=False)
  return FORMS[name]


def xla_gemm(a, b, out_dtype, axes: tuple[int, int], *,
             platform: str = "cpu", arch: str | None = None) -> jax.Array:
  """The ``xla`` backend's form for ``platform`` (default: the CPU reference),
  called directly, without a platform branch."""
  c = choose(a, b, platform, arch, backend="xla")
  return _form(c.form, "xla")(a, b, out_dtype, tuple(axes))


def gemm(a, b, *, axes: tuple[int, int], out_dtype,
         backend: str | None = None) -> jax.Array:
  """Product of two 2-D operands contracted over ``axes`` (one per operand).

  ``a`` and ``b`` are both `QTensor` (quantized along their contraction axis)
  or both plain arrays. The result has shape ``(free dim of a, free dim of
  b)`` and dtype ``out_dtype``; accumulation is FP32. One branch is traced
  per distinct choice over `PLATFORMS`; the lowering keeps only its own.
  """
  if isinstance(a, QTensor) != isinstance(b, QTensor):
    raise TypeError("gemm operands must both be QTensor or both be arrays.")
  if isinstance(a, QTensor) and (a.axis, b.axis) != tuple(axes):
    raise ValueError(f"operands were quantized along axes {(a.axis, b.axis)}"
                     f" but the GEMM contracts {tuple(axes)}.")
  axes = tuple(axes)
  if (isinstance(a, QTensor) and sharding.auto_mesh() is not None
      and not sharding.unpartitioned_now()
      and (_chooses_ffi(a, b, backend) or sharding.quantized_gather())):
    return partition.gemm(a, b, axes, out_dtype, backend or "default")
  return _dispatched(a, b, axes, out_dtype, backend)


def _chooses_ffi(a, b, backend) -> bool:
  return any(choose(a, b, p, gpu_arch(p), backend=backend).backend == "ffi"
             for p in PLATFORMS)


def _dispatched(a, b, axes, out_dtype, backend) -> jax.Array:
  """The GEMM on the operands as they are (on one device, or on each
  device's shards inside `qlayers.partition`)."""
  # Lowered for CPU only where no GPU can be the target: the other branches
  # would be traced only to be dropped.
  platforms = PLATFORMS if targets_gpu() else ("cpu",)
  forms = {p: choose(a, b, p, gpu_arch(p), backend=backend).form
           for p in platforms}
  branches: dict[str, Callable] = {}
  for form in forms.values():
    if form not in branches:
      branches[form] = functools.partial(
          lambda form, a, b: _form(form, backend)(a, b, out_dtype, axes),
          form)
  if len(branches) == 1:
    return next(iter(branches.values()))(a, b)
  return lax.platform_dependent(
      a, b, **{p: branches[form] for p, form in forms.items()})


# The partitioning rule calls the local GEMM by name (a hashable static
# argument): the forced backend, or "default" for the table's choice.
for _name in ("default",) + BACKENDS:
  partition.register_local(
      _name, functools.partial(
          lambda backend, a, b, axes, out_dtype: _dispatched(
              a, b, axes, out_dtype, backend),
          None if _name == "default" else _name))


# ----------------------------------------------------------------------------
# Report

# Targets `report` describes: (platform, architecture).
REPORT_TARGETS = (("cpu", None), ("cuda", "sm_90"), ("cuda", "sm_100"),
                  ("rocm", "gfx942"), ("rocm", "gfx950"))


def _recipe_choices(recipe, platform: str, arch: str | None) -> dict:
  """Backend, form and reason per GEMM of a recipe on a 256x256 layer."""
  from qlayers import scaling  # pylint: disable=g-import-not-at-top
  out = {}
  for name, gemm_recipe, axes in (("fprop", recipe.fprop, (1, 0)),
                                  ("dgrad", recipe.dgrad, (1, 1)),
                                  ("wgrad", recipe.wgrad, (0, 0))):
    lhs, rhs = gemm_recipe.lhs, gemm_recipe.rhs
    if lhs is None:
      out[name] = {"backend": "xla", "form": "wide", "why": "unquantized"}
      continue
    def q(spec, axis):
      last = spec.fmt.packed or prefers_contraction_last(spec.granularity)
      key = jax.random.key(0) if spec.stochastic else None
      return jax.eval_shape(lambda: scaling.quantize(
          jnp.zeros((256, 256)), spec, 1 if last else axis, key=key))
    qa, qb = q(lhs, axes[0]), q(rhs, axes[1])
    try:
      c = choose(qa, qb, platform, arch)
      out[name] = {"backend": c.backend, "form": c.form, "why": c.why}
    except ValueError as e:  # a forced backend that cannot run it
      out[name] = {"backend": "error", "form": "", "why": str(e)}
  return out


def report() -> dict:
  """What is available, and which backend each named recipe's GEMMs use.

  ``chosen`` is for the host platform and its Fprop; ``targets`` has every
  GEMM of every recipe for each of `REPORT_TARGETS` (``"cuda sm_90"``, ...);
  ``native_quantize`` says whether a program lowered for CPU now runs the
  native kernels of `qlayers.native_quantize` (FP8 and MXFP8 quantize, the
  MXFP8 GEMM's BF16 operands, delayed scaling), and if not, why.

  Example:
    >>> import qlayers
    >>> info = qlayers.backends()
    >>> sorted(info)
    ['available', 'chosen', 'ffi_build', 'forced', 'native_quantize', 'platform', 'targets']
    >>> info["targets"]["cuda sm_100"]["mxfp8"]["fprop"]["form"]
    'mx_cudnn'
  """
  from qlayers.recipe import available_recipes, recipe as load  # pylint: disable=g-import-not-at-top
  native = _native()
  ffi_ok = bool(native and native.available())
  host = _host_platform()
  recipes = {name: load(name) for name in available_recipes()}
  chosen = {}
  for name, r in recipes.items():
    fprop = _recipe_choices(r, host, gpu_arch(host))["fprop"]
    chosen[name] = {"backend": fprop["backend"], "why": fprop["why"]}
  targets = {}
  for platform, arch in REPORT_TARGETS:
    key = platform + (f" {arch}" if arch else "")
    targets[key] = {name: _recipe_choices(r, platform, arch)
                    for name, r in recipes.items()}
  from qlayers import scaling  # pylint: disable=g-import-not-at-top
  used, why = native_quantize.applies(
      jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
      scaling.QuantSpec(format="e4m3", granularity="tensor"))
  return {
      "platform": host,
      "available": {"xla": True, "ffi": ffi_ok},
      "native_quantize": {"cpu": used, "why": why},
      "ffi_build": native.build_info() if native else "qlayers._native missing",
      "forced": os.environ.get("QLAYERS_BACKEND"),
      "chosen": chosen,
      "targets": targets,
  }
