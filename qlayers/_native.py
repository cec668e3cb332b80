"""Bindings for the native XLA FFI kernels built from ``ffi/``.

The kernels live in plain shared libraries in the package's folders (or a
folder given to `load`): ``libqlayers_cpu.so`` always;
``libqlayers_cuda.so`` / ``libqlayers_rocm.so`` where cuBLASLt / hipBLASLt
were found at build time. They are loaded with
``ctypes`` on first use and each handler symbol is registered with
``jax.ffi.register_ffi_target``; no Python extension module is involved.
A GPU library is loaded only when jax sees devices of its kind, or when
`load` is told ``gpu_without_device=True`` (compiling for a GPU that is not
attached: loading needs the BLAS library, not a device).

Every GEMM computes ``OUT = A @ B^T`` with ``A`` of shape ``(M, K)`` and ``B``
of shape ``(N, K)`` (both contraction-last, the "TN" layout), FP32
accumulation, and an ``float32`` or ``bfloat16`` output. Scales are
dequantization factors: ``value = decode(payload) * scale``.

Payload encodings (the contract with ``formats.py``):

* fp8: ``float8_e4m3fn`` / ``float8_e5m2`` arrays (``*_fnuz`` for the
  per-tensor and blockwise GEMMs), one byte per element; MX also accepts the
  same codes as ``uint8``.
* fp4 E2M1: ``uint8`` ``(rows, K/2)``, element ``2i`` in the low nibble and
  ``2i+1`` in the high nibble.
* fp6 E3M2 / E2M3: ``uint8`` ``(rows, 3K/4)``; four elements in three bytes,
  ``w = v0 | v1 << 6 | v2 << 12 | v3 << 18`` stored little-endian.
* MX scales: ``uint8`` E8M0 codes ``(rows, K/32)``, value ``2**(code-127)``,
  ``0xFF`` is NaN.

If the native library is missing (a source checkout that was never built),
importing this module still works: :func:`available` is ``False`` and
:func:`unavailable_reason` says why. From a source tree, build it with
``bash ffi/build_inplace.sh``. Example: ``if _native.available():
_native.gemm_fp8_tensor(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16)``.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "available",
  "unavailable_reason",
  "build_info",
  "gemm_fp8_tensor",
  "gemm_mx",
  "gemm_blockwise",
  "gemm_fp8_rowwise",
  "MX_FORMATS",
  "NATIVE_GRANULARITIES",
  "load",
  "loaded",
  "supports",
  "gemm",
]

# FFI target name -> exported C symbol, per library.
_CPU_HANDLERS = {
  "qlayers_gemm_fp8_tensor": "QlayersGemmFp8Tensor",
  "qlayers_gemm_mx": "QlayersGemmMx",
  "qlayers_gemm_blockwise": "QlayersGemmBlockwise",
}
_GPU_HANDLERS = {
  "qlayers_gemm_fp8_tensor": "QlayersGemmFp8TensorGpu",
  "qlayers_gemm_mx": "QlayersGemmMxGpu",
}
# Registered when the library has them: the cuBLASLt >= 12.9 (sm_90) scale
# modes OUTER_VEC_32F (row-wise) and VEC128_32F / BLK128x128_32F (blockwise).
_OPTIONAL_GPU_HANDLERS = {
  "qlayers_gemm_fp8_rowwise": "QlayersGemmFp8RowwiseGpu",
  "qlayers_gemm_blockwise": "QlayersGemmBlockwiseGpu",
}
# backend -> (library file, XLA platform name, handlers, info symbol)
_LIBRARIES = {
  "cpu": ("libqlayers_cpu.so", "cpu", _CPU_HANDLERS, "QlayersCpuInfo"),
  "cuda": ("libqlayers_cuda.so", "CUDA", _GPU_HANDLERS, "QlayersGpuInfo"),
  "rocm": ("libqlayers_rocm.so", "ROCM", _GPU_HANDLERS, "QlayersGpuInfo"),
}

MX_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
_WIDE_OUTPUTS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_lock = threading.Lock()
_state: dict[str, Any] | None = None


def _library_dirs(directory=None) -> list[pathlib.Path]:
  """Where the libraries are looked for, in order.

  ``directory`` if given (`load`), then the folders of the ``qlayers`` package, where
  ``pip install`` (editable or not) and ``ffi/build_inplace.sh`` put them.
  """
  dirs = [pathlib.Path(directory)] if directory else []
  package = sys.modules.get(__package__ or "")
  # An editable install splits the package over the source tree and the
  # folder pip installed the built files into.
  dirs.extend(pathlib.Path(p) for p in getattr(package, "__path__", []))
  here = pathlib.Path(__file__).resolve().parent
  return list(dict.fromkeys([*dirs, here]))


def _find(filename: str, directory=None) -> pathlib.Path | None:
  for d in _library_dirs(directory):
    path = d / filename
    if path.is_file():
      return path
  return None


def _has_devices(backend: str) -> bool:
  try:
    return bool(jax.devices(backend))
  except (RuntimeError, ValueError):
    return False


def _load_one(backend: str, directory=None,
              gpu_without_device: bool = False) -> dict[str, Any]:
  filename, platform, handlers, info_symbol = _LIBRARIES[backend]
  path = _find(filename, directory)
  if path is None:
    return {"loaded": False, "path": None, "reason": f"{filename} not found"}
  if (backend != "cpu" and not _has_devices(backend)
      and not gpu_without_device):
    # Do not pull cuBLASLt/hipBLASLt into a process that cannot use them.
    return {"loaded": False, "path": str(path),
            "reason": f"jax sees no {backend} devices"}
  targets = []
  try:
    lib = ctypes.CDLL(str(path))
    optional = _OPTIONAL_GPU_HANDLERS if backend != "cpu" else {}
    for target, symbol in {**handlers, **optional}.items():
      if target in optional and not hasattr(lib, symbol):
        continue
      capsule = jax.ffi.pycapsule(getattr(lib, symbol))
      jax.ffi.register_ffi_target(target, capsule, platform=platform)
      targets.append(target)
    info_fn = getattr(lib, info_symbol)
    info_fn.restype = ctypes.c_char_p
    info_fn()
  except (OSError, AttributeError, RuntimeError, ValueError) as e:
    return {"loaded": False, "path": str(path), "reason": f"{type(e).__name__}: {e}"}
  return {"loaded": True, "path": str(path), "reason": "", "info_fn": info_fn, "lib": lib,
          "targets": tuple(targets)}


def _load() -> dict[str, Any]:
  global _state
  with _lock:
    if _state is None:
      _state = {backend: _load_one(backend) for backend in _LIBRARIES}
    return _state


def load(directory: str | os.PathLike | None = None, *,
         gpu_without_device: bool = False) -> dict[str, Any]:
  """Loads the native libraries now: from ``directory`` first (a sanitizer
  or CUDA build folder), then the package's folders; with
  ``gpu_without_device`` the GPU libraries are registered although jax sees
  no GPU (to compile for one that is not attached). Call it before the
  first GEMM is traced (by default they load on first use). Returns
  `build_info`, e.g. ``sorted(load())`` is ``['cpu', 'cuda', 'details',
  'rocm']``."""
  global _state
  with _lock:
    state = {}
    for b, (filename, *_) in _LIBRARIES.items():
      old = (_state or {}).get(b)
      if old is None or not old["loaded"]:
        state[b] = _load_one(b, directory, gpu_without_device)
        continue
      # XLA keeps a registered handler for the process: another file's
      # cannot replace it.
      path = _find(filename, directory)
      if path is not None and not os.path.samefile(path, old["path"]):
        raise RuntimeError(
            f"qlayers' {b} kernels are registered already, from "
            f"{old['path']}; another library ({path}) can only be loaded "
            f"in a new process, before its first GEMM, qlayers.backends() "
            f"or available().")
      state[b] = old
    _state = state
  return build_info()


def available() -> bool:
  """Whether the native CPU kernels are built and registered with XLA."""
  return _load()["cpu"]["loaded"]


def loaded(platform: str) -> tuple[str, ...]:
  """FFI targets registered for ``platform`` (``cpu``, ``cuda``, ``rocm``);
  empty when its library is not loaded."""
  entry = _load().get(platform)
  return entry.get("targets", ()) if entry and entry["loaded"] else ()


def unavailable_reason() -> str:
  """Why the native CPU kernels are unavailable ("" when they are)."""
  cpu = _load()["cpu"]
  if cpu["loaded"]:
    return ""
  return (
    f"qlayers native CPU kernels unavailable ({cpu['reason']}); install the "
    "package with `pip install .` or run `bash ffi/build_inplace.sh` in a "
    "source checkout"
  )


def build_info() -> dict[str, Any]:
  """Which native targets are loaded and registered: ``{"cpu": bool, "cuda":
  bool, "rocm": bool, "details": {backend: {"path", "reason", "info"}}}``.

  ``path`` is the library file if one was found (a GPU library is only
  loaded when jax has devices of that kind), ``info`` describes the build
  (e.g. ``"isa=avx512 tile=12x32 threads=2 openmp=1"``) and ``reason`` says
  why a target is not loaded.
  """
  state = _load()
  details = {}
  for backend, entry in state.items():
    details[backend] = {k: entry[k] for k in ("path", "reason")}
    if entry["loaded"]:
      details[backend]["info"] = entry["info_fn"]().decode()
  return {backend: entry["loaded"] for backend, entry in state.items()} | {
    "details": details
  }


def _force_cpu_isa(isa: str | None) -> bool:
  """Test hook: run the CPU GEMMs with the ``"avx512"``, ``"avx2"`` or
  ``"generic"`` micro-kernel (``None``: the detected one). False if this CPU
  lacks that ISA."""
  _require()
  lib = _load()["cpu"]["lib"]
  return bool(lib.QlayersCpuForceIsa((isa or "").encode()))


def _require() -> None:
  if not available():
    raise RuntimeError(unavailable_reason())


def _out_dtype(out_dtype) -> jnp.dtype:
  dt = jnp.dtype(out_dtype)
  if dt not in _WIDE_OUTPUTS:
    raise ValueError(f"out_dtype must be float32 or bfloat16, got {dt}")
  return dt


def _rows(x, name: str) -> int:
  if jnp.ndim(x) != 2:
    raise ValueError(f"{name} must be a 2-D (rows, K) array, got shape {jnp.shape(x)}")
  return jnp.shape(x)[0]


def _scale(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _call(target: str, out, *args, **attrs):
  # vmap runs the kernel once per batch element; the kernels take 2-D
  # operands only, so no batched lowering is claimed.
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)


def gemm_fp8_tensor(a, a_scale, b, b_scale, *, out_dtype=jnp.float32) -> jax.Array:
  """Per-tensor scaled fp8 GEMM: ``(decode(a) @ decode(b).T) * a_scale * b_scale``.

  Args:
    a: ``(M, K)`` fp8 (any mix of e4m3/e5m2, or their fnuz variants with b).
    a_scale: f32 scalar, shape ``()`` or ``(1,)``; dequantization factor.
    b: ``(N, K)`` fp8.
    b_scale: f32 scalar.
    out_dtype: ``float32`` or ``bfloat16``.

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  _require()
  out = jax.ShapeDtypeStruct((_rows(a, "a"), _rows(b, "b")), _out_dtype(out_dtype))
  return _call("qlayers_gemm_fp8_tensor", out, a, _scale(a_scale), b, _scale(b_scale))


def gemm_mx(
  a, a_scales, b, b_scales, *, a_format: str, b_format: str, out_dtype=jnp.float32
) -> jax.Array:
  """OCP MX GEMM: 32-element blocks along K, one E8M0 scale per block.

  Args:
    a: ``(M, K)`` fp8 (or its ``uint8`` codes) for e4m3/e5m2, packed
      ``uint8`` ``(M, 3K/4)`` for e3m2/e2m3 and ``(M, K/2)`` for e2m1.
    a_scales: ``uint8`` E8M0 codes ``(M, K/32)``; ``0xFF`` makes the
      affected outputs NaN. K must be a multiple of 32.
    b: like ``a`` with ``N`` rows.
    b_scales: ``uint8`` ``(N, K/32)``.
    a_format, b_format: one of :data:`MX_FORMATS`.
    out_dtype: ``float32`` or ``bfloat16``.

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  _require()
  for name, fmt in (("a_format", a_format), ("b_format", b_format)):
    if fmt not in MX_FORMATS:
      raise ValueError(f"{name} must be one of {MX_FORMATS}, got {fmt!r}")
  out = jax.ShapeDtypeStruct((_rows(a, "a"), _rows(b, "b")), _out_dtype(out_dtype))
  return _call(
    "qlayers_gemm_mx", out, a, a_scales, b, b_scales,
    a_format=a_format, b_format=b_format,
  )


def gemm_fp8_rowwise(a, a_scales, b, b_scales, *, out_dtype=jnp.float32) -> jax.Array:
  """Row-wise scaled fp8 GEMM (GPU only: cuBLASLt ``OUTER_VEC_32F``, sm_90):
  ``(decode(a) @ decode(b).T) * a_scales[:, None] * b_scales[None, :]``.

  Args:
    a: ``(M, K)`` fp8 (e4m3/e5m2; not both e5m2).
    a_scales: f32 ``(M,)``, one dequantization factor per row of ``a``.
    b: ``(N, K)`` fp8.
    b_scales: f32 ``(N,)``.
    out_dtype: ``float32`` or ``bfloat16``.

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  out = jax.ShapeDtypeStruct((_rows(a, "a"), _rows(b, "b")), _out_dtype(out_dtype))
  return _call("qlayers_gemm_fp8_rowwise", out, a, jnp.reshape(_scale(a_scales), (-1,)),
               b, jnp.reshape(_scale(b_scales), (-1,)))


def gemm_blockwise(
  a, a_scales, b, b_scales, *, a_rows_per_scale: int = 1,
  b_rows_per_scale: int = 128, out_dtype=jnp.float32,
) -> jax.Array:
  """Fine-grained fp8 GEMM (DeepSeek-V3): f32 scales per 128-wide K chunk.

  Each 128-wide K chunk's partial sum is accumulated in FP32 and multiplied
  by ``a_scale * b_scale`` of that chunk before it is added to the total.

  Args:
    a: ``(M, K)`` fp8, K a multiple of 128 (pad with zeros).
    a_scales: f32 ``(ceil(M / a_rows_per_scale), K / 128)``.
    b: ``(N, K)`` fp8.
    b_scales: f32 ``(ceil(N / b_rows_per_scale), K / 128)``.
    a_rows_per_scale, b_rows_per_scale: 1 (1x128 tiles) or 128 (128x128
      blocks).
    out_dtype: ``float32`` or ``bfloat16``.

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  _require()
  out = jax.ShapeDtypeStruct((_rows(a, "a"), _rows(b, "b")), _out_dtype(out_dtype))
  return _call(
    "qlayers_gemm_blockwise", out, a, a_scales, b, b_scales,
    a_rows_per_scale=np.int64(a_rows_per_scale),
    b_rows_per_scale=np.int64(b_rows_per_scale),
  )


# ----------------------------------------------------------------------------
# QTensor adapters for `qlayers.dispatch` (duck-typed: payload, scale, format,
# granularity, block, axis, shape; see `qlayers.scaling.QTensor`).

_BLOCKWISE = {(1, 128): 1, (128, 128): 128}
_FP8_FORMATS = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")
# Granularities some native kernel takes (on some platform).
NATIVE_GRANULARITIES = ("tensor", "row", "tile", "block", "mx")
# What each GPU library's handlers accept beyond the CPU's contract, and the
# shapes they need (ffi/gpu/blaslt_gemm.cu): M and N multiples of 16, K a
# multiple of 16 (fp8), 32 (MX on CUDA) or 128 (MX on ROCm, blockwise).
_GPU_MX_FORMATS = ("e4m3", "e5m2")
_GPU_K_MULTIPLE = {("cuda", "tensor"): 16, ("cuda", "row"): 16,
                   ("cuda", "mx"): 32, ("cuda", "blockwise"): 128,
                   ("rocm", "tensor"): 16, ("rocm", "mx"): 128}
# cuBLASLt's sm_90 block-scaling pairs (Fprop/Dgrad: tiles x blocks; Wgrad:
# tiles x tiles; also blocks x tiles), not blocks x blocks: the pairs PyTorch's
# _scaled_mm sends to cuBLASLt (aten/src/ATen/native/cuda/ScaledBlas.cpp),
# which also restricts them to sm_90 and cuBLAS >= 12.9.
_GPU_BLOCK_PAIRS = {((1, 128), (128, 128)), ((128, 128), (1, 128)),
                    ((1, 128), (1, 128))}


def supports(a, b, platform: str | None = "cpu") -> tuple[bool, str]:
  """Whether :func:`gemm` can multiply these two quantized operands there.

  Returns ``(ok, reason)``. The kernels take 2-D operands quantized along
  their last axis (``A (M, K)``, ``B (N, K)``) with matching granularities:
  tensor x tensor (fp8), mx x mx, or tile/block x tile/block (128-wide) on
  CPU; on ``cuda``/``rocm`` what that GPU library registered, with its
  formats and shapes (which GPU generation runs a kernel is
  `qlayers.table.FFI_ARCH`). ``platform=None`` checks only the operands.
  """
  if platform == "cpu" and not available():
    return False, unavailable_reason()
  for name, q in (("a", a), ("b", b)):
    if len(q.shape) != 2:
      return False, f"{name} is rank {len(q.shape)}; the native kernels take 2-D operands"
    if q.axis != 1:
      return False, (f"{name} is quantized along axis {q.axis}; the native "
                     "kernels need contraction-last (TN) operands")
  ga, gb = a.granularity, b.granularity
  if ga == gb == "tensor":
    kind, target = "tensor", "qlayers_gemm_fp8_tensor"
    if a.format not in _FP8_FORMATS or b.format not in _FP8_FORMATS:
      return False, f"per-tensor {a.format} x {b.format} is not an fp8 pair"
    what = "per-tensor fp8 kernel"
  elif ga == gb == "row":
    kind, target = "row", "qlayers_gemm_fp8_rowwise"
    if a.format not in _FP8_FORMATS or b.format not in _FP8_FORMATS:
      return False, f"row-wise {a.format} x {b.format} is not an fp8 pair"
    what = "row-wise fp8 kernel"
  elif ga == gb == "mx":
    kind, target = "mx", "qlayers_gemm_mx"
    if a.block != (1, 32) or b.block != (1, 32):
      return False, f"MX blocks {a.block} x {b.block}; the kernels use (1, 32)"
    what = "MX kernel"
  elif ga in ("tile", "block") and gb in ("tile", "block"):
    kind, target = "blockwise", "qlayers_gemm_blockwise"
    if a.format not in _FP8_FORMATS or b.format not in _FP8_FORMATS:
      return False, f"blockwise {a.format} x {b.format} is not an fp8 pair"
    if a.block not in _BLOCKWISE or b.block not in _BLOCKWISE:
      return False, f"blocks {a.block} x {b.block}; the kernels use 1x128 / 128x128"
    what = "blockwise fp8 kernel"
  else:
    return False, f"no native kernel for {ga} x {gb} operands"
  if platform is None:
    return True, what
  if platform not in _LIBRARIES:
    return False, f"no native library for platform {platform!r}"
  if target not in loaded(platform):
    entry = _load()[platform]
    if entry["loaded"]:
      return False, (f"{_LIBRARIES[platform][0]} has no {what} for "
                     f"{platform} (no {target} handler)")
    return False, (f"{_LIBRARIES[platform][0]} not loaded for {platform} "
                   f"({entry['reason']})")
  if platform == "cpu":
    return True, what
  return _gpu_supports(a, b, platform, kind, what)


def _gpu_supports(a, b, platform, kind, what) -> tuple[bool, str]:
  """The GPU kernels' own limits (formats, shapes)."""
  if platform == "cuda" and any(f.endswith("fnuz") for f in (a.format, b.format)):
    return False, "CUDA has no FNUZ fp8 types"
  if {a.format, b.format} <= {"e5m2", "e5m2fnuz"}:
    return False, "e5m2 x e5m2 has no fp8 BLAS kernel"
  if kind == "mx":
    if a.format not in _GPU_MX_FORMATS or b.format not in _GPU_MX_FORMATS:
      return False, (f"the {platform} MX kernel takes e4m3/e5m2 payloads, "
                     f"got {a.format} x {b.format}")
  if kind == "blockwise":
    if (a.block, b.block) not in _GPU_BLOCK_PAIRS:
      return False, f"cuBLASLt has no {a.block} x {b.block} block-scaled pair"
    if a.format != "e4m3" or b.format != "e4m3":
      return False, f"cuBLASLt block scaling takes e4m3 x e4m3, got {a.format} x {b.format}"
  k_multiple = _GPU_K_MULTIPLE.get((platform, kind))
  if k_multiple is None:
    return False, f"no {kind} kernel on {platform}"
  m, k = a.payload.shape[0], a.payload.shape[-1]
  n = b.payload.shape[0]
  if kind == "mx" or a.fmt.packed:
    k = a.scale.shape[-1] * 32
  if m % 16 or n % 16 or k % k_multiple:
    return False, (f"the {platform} kernels need M and N multiples of 16 and K a "
                   f"multiple of {k_multiple}; got M={m}, N={n}, K={k}")
  return True, what


def gemm(a, b, *, out_dtype, platform: str | None = None) -> jax.Array:
  """``dequantize(a) @ dequantize(b).T`` for two supported QTensors.

  ``a`` is ``(M, K)`` and ``b`` is ``(N, K)``, both quantized along K; the
  result is ``(M, N)`` in ``out_dtype`` (padding rows are cropped). The
  operands are checked for ``platform`` (see :func:`supports`; None: the
  contract only, for a call whose platform is decided at lowering).
  """
  ok, why = supports(a, b, platform=platform)
  if not ok:
    raise ValueError(f"native gemm cannot run these operands: {why}")
  dt = jnp.dtype(out_dtype)
  wide = dt if dt in _WIDE_OUTPUTS else jnp.dtype(jnp.float32)
  if a.granularity == "tensor":
    out = gemm_fp8_tensor(a.payload, a.scale, b.payload, b.scale, out_dtype=wide)
  elif a.granularity == "row":
    out = gemm_fp8_rowwise(a.payload, a.scale, b.payload, b.scale, out_dtype=wide)
  elif a.granularity == "mx":
    out = gemm_mx(a.payload, a.scale, b.payload, b.scale, a_format=a.format,
                  b_format=b.format, out_dtype=wide)
  else:
    out = gemm_blockwise(a.payload, a.scale, b.payload, b.scale,
                         a_rows_per_scale=_BLOCKWISE[a.block],
                         b_rows_per_scale=_BLOCKWISE[b.block], out_dtype=wide)
  out = out[: a.shape[0], : b.shape[0]]
  return out if out.dtype == dt else out.astype(dt)
