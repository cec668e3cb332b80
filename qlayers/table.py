"""The capability table: which backend and kernel form runs a GEMM of two
operands, per platform and GPU generation.

`TABLE` holds every rule, first match wins: (platform, architecture,
granularity, element format) -> (backend, form, why); `choose` applies it
(an ``ffi`` row only where the native kernel takes the operands there:
`qlayers._native.supports`). A forced backend (``backend=``, else
``$QLAYERS_BACKEND``) is one more input. The GPU *generation* a lowering
platform cannot see comes from `gpu_arch`: the `target_arch` context
manager (part of jax's cache keys), else ``$QLAYERS_GPU_ARCH`` (``sm_90``,
``sm_100``, ``gfx942``, ``gfx950``), else the GPUs jax sees.
`qlayers.dispatch` reads it once per matmul to make the GEMM plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from typing import Callable, Iterator

import jax

from qlayers import _native
from qlayers.scaling import QTensor

__all__ = ["TABLE", "Rule", "Choice", "choose", "select", "target_arch",
           "gpu_arch", "targets_gpu", "sm_version", "fp8_gemm_transposes",
           "prefers_contraction_last", "BACKENDS",
           "PLATFORMS", "FFI_ARCH", "ffi_supports"]

BACKENDS = ("xla", "ffi")
# Platforms `gemm` compiles a branch for ("tpu" takes the generic rules).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


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
  Where no GPU is attached and no mesh is set, its GPU is also jax's
  abstract device (``jax.sharding.AbstractMesh(abstract_device=...)``),
  which jax >= 0.11 needs to lower the Pallas kernels for it.

  Example:
    >>> with target_arch("sm_100"):
    ...   gpu_arch("cuda")
    'sm_100'
  """
  if not _ARCH.match(arch):
    raise ValueError(f"Unknown GPU architecture {arch!r}; expected e.g. "
                     "'sm_90', 'sm_100', 'gfx942' or 'gfx950'.")
  with _TARGET(arch), _abstract_gpu(arch):
    yield


# A GPU of each generation by the name jax knows it (jax >= 0.11 lowers a
# Pallas kernel for the GPU its abstract device names, when none is attached).
_GPU_KIND = {"sm_80": "NVIDIA A100", "sm_89": "NVIDIA L4",
             "sm_90": "NVIDIA H100", "sm_100": "NVIDIA B200",
             "sm_103": "NVIDIA B300", "sm_120": "NVIDIA RTX PRO 6000"}


def _abstract_gpu(arch: str):
  """Names ``arch``'s GPU as jax's abstract device, where no GPU is attached
  and no mesh is set (a mesh's own device stays)."""
  kind = arch if arch.startswith("gfx") else _GPU_KIND.get(arch)
  if (kind is None or not jax.sharding.get_abstract_mesh().empty
      or jax.default_backend() != "cpu"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None,
                                       platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device))


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


def sm_version(arch: str | None) -> int:
  """``sm_90`` -> 90 (0 when unknown or not CUDA).

  Example:
    >>> sm_version("sm_100"), sm_version("gfx950"), sm_version(None)
    (100, 0, 0)
  """
  return int(arch[3:]) if arch and arch.startswith("sm_") else 0


def fp8_gemm_transposes(arch: str | None) -> bool:
  """Whether XLA's cuBLASLt FP8 GEMM on ``arch`` takes only operands whose
  contraction axis is the minor one (TN), transposing any other: Ada and
  Hopper (sm_89, sm_90). Blackwell (sm_100+) takes every layout, as the
  sm_100 programs of ``benchmarks/gpu_compile.py`` show (no payload
  transposes)."""
  return 89 <= sm_version(arch) < 100


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
  applies only when the native kernel supports the operands there; a
  ``pow2`` row only when both operands' tile/block scales are powers of two
  (UE8M0, `QuantSpec.pow2`), which the traced scales cannot tell; a
  ``levels`` row only when both carry their NVFP4 scale levels apart
  (`QTensor.block_scale`, ``tensor_scale``).
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
  pow2: bool = False
  levels: bool = False

  def matches(self, platform, arch, granularity, kinds, pow2=False,
              levels=False) -> bool:
    return (self.platform in (platform, "*") and self.arch_ok(arch)
            and granularity in self.granularity
            and set(kinds) <= set(self.kinds) and (pow2 or not self.pow2)
            and (levels or not self.levels))


_ANY = ("fp8", "fp6", "fp4")
_HOPPER = lambda arch: 90 <= sm_version(arch) < 100  # noqa: E731
_MX_CORES = lambda arch: sm_version(arch) >= 100  # noqa: E731
_GFX950 = lambda arch: arch == "gfx950"  # noqa: E731
_GFX942 = lambda arch: arch == "gfx942"  # noqa: E731

TABLE: tuple[Rule, ...] = (
    # --- CPU: the numerical reference (benchmarks/RESULTS.md for speed).
    Rule("cpu", "any", ("tensor", "row"), ("fp8",), "xla", "cpu_fp8",
         "exact BF16 copies of the FP8 payloads + XLA's BF16 dot (FP32 "
         "accumulation): about twice XLA's FP8 dot, which upcasts to FP32"),
    Rule("cpu", "any", ("blockwise", "mixed"), _ANY, "xla", "f32_emulation",
         "FP32 emulation (arbitrary FP32 tile/block scales): about as fast "
         "as the native kernel on CPU"),
    Rule("cpu", "any", ("mx",), _ANY, "xla", "cpu_mx",
         "exact BF16 dequantize + XLA's BF16 dot (FP32 accumulation) "
         "beats the native MX GEMM on CPU"),
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
         "XLA's block-scaled dot (qlayers.block_scaled_dot) -> cuDNN "
         "block-scaled MXFP8 GEMM",
         arch_ok=_MX_CORES),
    Rule("cuda", "sm_100+", ("mx",), ("fp4",), "xla", "nvfp4_cudnn",
         "MXFP4 as NVFP4 (forms.as_nvfp4: a block of 32 with E8M0 scale 2^k "
         "is two of 16 with E4M3 scale 2^(k-c) under a per-tensor 2^c, c = "
         "the largest k - 8) + cuDNN NVFP4 block-scaled GEMM (E2M1 x E2M1) "
         "at the FP4 rate, the per-tensor scales its global scale: exact, "
         "but blocks more than 2^17 below the largest (values under "
         "2^-17 of the amax) are flushed to zero; the pinned XLA (jaxlib "
         "0.10.2) turns MXFP4 with E8M0 scales into a BF16 dequantize",
         arch_ok=_MX_CORES),
    Rule("cuda", "sm_100+", ("mx",), _ANY, "xla", "mx_cudnn",
         "FP6 (and FP4 beside FP6/FP8) payloads widened exactly to E4M3 "
         "(every E2M1, E2M3 and E3M2 value is one) + cuDNN MXFP8 "
         "block-scaled GEMM, at the FP8 (= FP6) MMA rate: the pinned XLA "
         "(jaxlib 0.10.2) fails to compile FP6 operands of its "
         "block-scaled dot ('Invalid bitcast i6 to i8')",
         arch_ok=_MX_CORES),
    Rule("cuda", "sm_100+", ("blockwise",), ("fp8",), "xla", "ue8m0_cudnn",
         "UE8M0 tiles/blocks as MXFP8 (a 1x128 tile scale is four equal "
         "32-element E8M0 scales, a 128x128 block's repeats per row) + cuDNN "
         "block-scaled GEMM: bit-identical to the emulation",
         arch_ok=_MX_CORES, pow2=True),
    Rule("cuda", "sm_100+", ("blockwise",), ("fp4",), "xla", "nvfp4_cudnn",
         "cuDNN's NVFP4 GEMM (block-scaled, E2M1 x E2M1, the E4M3 scales "
         "per 16; a 16x16 weight block's repeated per row) at the FP4 rate, "
         "the per-tensor scales' product its global scale (cuDNN's alpha, in "
         "the output dtype: BF16 outputs are scaled by it rounded to "
         "BF16), output written in its final dtype",
         arch_ok=_MX_CORES, levels=True),
    Rule("cuda", "sm_100+", ("blockwise",), ("fp4",), "xla", "f32_dequant",
         "FP32 dequantize + TF32 dot: these NVFP4 operands were rebuilt "
         "from payload + scale alone, the FP32 product of their two scale "
         "levels, which cuDNN's NVFP4 GEMM cannot take", arch_ok=_MX_CORES),
    # --- AMD (lowered here, not compiled: no ROCm toolchain on this host).
    Rule("rocm", "gfx942", ("tensor",), ("fp8",), "xla", "fp8_fnuz_folded",
         "FNUZ FP8 dot_general (gfx942 has no OCP FP8: payloads halved "
         "exactly into E4M3FNUZ/E5M2FNUZ, scales doubled) with the scales on "
         "its output: XLA rewrites it to hipBLASLt FP8", arch_ok=_GFX942),
    Rule("rocm", "gfx942", ("row",), ("fp8",), "xla", "fp8_fnuz_rowwise",
         "FNUZ FP8 dot_general with BF16 output and the vector scales after "
         "it (gfx942 has no OCP FP8)", arch_ok=_GFX942),
    Rule("rocm", "any", ("tensor",), ("fp8",), "xla", "fp8_folded",
         "FP8 dot_general with the scales on its output: XLA rewrites it to "
         "hipBLASLt FP8"),
    Rule("rocm", "any", ("row",), ("fp8",), "xla", "fp8_rowwise",
         "FP8 dot_general with BF16 output and the vector scales after it"),
    Rule("rocm", "gfx950", ("mx",), ("fp8",), "xla", "scaled_dot",
         "lax.scaled_dot -> hipBLASLt MX GEMM (gfx950, ROCm >= 7)",
         arch_ok=_GFX950),
    Rule("rocm", "gfx950", ("blockwise",), ("fp8",), "xla",
         "ue8m0_scaled_dot", "UE8M0 tiles/blocks as MXFP8 operands of "
         "lax.scaled_dot -> hipBLASLt MX GEMM (gfx950, ROCm >= 7)",
         arch_ok=_GFX950, pow2=True),
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


def check_backend(backend: str | None) -> str | None:
  """``backend`` if it is None or one of `BACKENDS`; else a ValueError."""
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"Unknown backend {backend!r}; expected one of "
                     f"{BACKENDS} (from the backend argument or "
                     "QLAYERS_BACKEND), or None: chosen per platform.")
  return backend


def _requested(backend: str | None) -> str | None:
  return check_backend(backend or os.environ.get("QLAYERS_BACKEND") or None)


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


# The GPU generations each native GPU kernel runs on, by operand
# granularity: the predicates of `TABLE`'s rows. `_native.supports` checks
# only what the library registered and its operand contract (formats,
# shapes); where a kernel may run is decided here.
FFI_ARCH: dict[tuple[str, str], tuple[str, Callable]] = {
    ("cuda", "row"): ("sm_90", _HOPPER),
    ("cuda", "blockwise"): ("sm_90", _HOPPER),
    ("cuda", "mx"): ("sm_100+", _MX_CORES),
    ("rocm", "mx"): ("gfx950", _GFX950),
}


def ffi_supports(a, b, platform: str, arch: str | None) -> tuple[bool, str]:
  """Whether the native kernel takes ``a`` and ``b`` on ``platform`` (GPU
  generation ``arch``, None: unknown) once they are laid out
  contraction-last (the ffi form does that), and if not, why."""
  ok, why = _native.supports(_tn_view(a), _tn_view(b), platform=platform)
  gran = _granularity(a, b)
  need = FFI_ARCH.get((platform, gran))
  if ok and need and not need[1](arch):
    where = f"{platform} {arch or '(unknown architecture)'}"
    return False, f"the {gran} kernel runs on {need[0]} only, not {where}"
  return ok, why


def choose(a, b, platform: str, arch: str | None = None, *,
           backend: str | None = None, pow2: bool = False) -> Choice:
  """The `Choice` for a GEMM of ``a`` and ``b`` lowered for ``platform``.

  ``arch`` is the GPU architecture (see `gpu_arch`; None: unknown);
  ``pow2``: both operands' tile/block scales are powers of two (the specs
  say so; the traced scales cannot). A forced
  ``ffi`` that cannot run there raises ValueError on a platform this process
  may lower for (`_active`), and falls back to the table elsewhere.
  """
  requested = _requested(backend)
  if not isinstance(a, QTensor):
    return Choice("xla", "cpu_wide" if platform == "cpu" else "wide",
                  "unquantized operands")
  where = platform + (f" {arch}" if arch else "")
  if requested == "ffi":
    ok, why = ffi_supports(a, b, platform, arch)
    if ok:
      return Choice("ffi", "ffi", "forced")
    if platform == "cpu" or _active(platform):
      raise ValueError(f"backend 'ffi' was forced but cannot run this GEMM "
                       f"on {where}: {why}.")
  gran = _granularity(a, b)
  kinds = (_kind(a), _kind(b))
  levels = all(q.tensor_scale is not None for q in (a, b))
  for rule in TABLE:
    if not rule.matches(platform, arch, gran, kinds, pow2, levels):
      continue
    if rule.backend == "ffi":
      if requested == "xla" or not ffi_supports(a, b, platform, arch)[0]:
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
           platform: str | None = None, *, pow2: bool = False
           ) -> tuple[str, str]:
  """``(backend, reason)`` for a GEMM of ``a`` and ``b`` on ``platform``
  (default: the host's jax backend); ``pow2``: their tile/block scales are
  powers of two (a UE8M0 recipe's specs say so, the QTensors cannot), as
  `choose` takes it."""
  platform = platform or _host_platform()
  c = choose(a, b, platform, gpu_arch(platform), backend=backend, pow2=pow2)
  return c.backend, c.why


def prefers_contraction_last(granularity: str,
                             backend: str | None = None) -> bool:
  """Whether operands of this granularity should be quantized contraction-last
  (TN layout) before any platform branch: only when the native kernels are
  forced (they take TN operands on every platform) and exist for it. Where the
  table picks ``ffi`` by itself, the GPU branch transposes the payload."""
  if _requested(backend) != "ffi":
    return False
  if not _native.available():
    return False
  return granularity in _native.NATIVE_GRANULARITIES
