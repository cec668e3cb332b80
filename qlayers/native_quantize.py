"""FP8 quantization (per tensor and MX) through native CPU kernels, where they apply.

`amax`, `history_max`, `quantize` and `dequantize` are drop-ins for
`qlayers.scaling.amax`, `qlayers.scaling.history_amax`,
`qlayers.scaling.quantize` and ``QTensor.dequantize(jnp.bfloat16)`` (MX, the
operands of the CPU MX GEMM) with the same results, bit for bit. In a program lowered for CPU they are one custom call
per pass over the tensor (the kernels of ``ffi/cpu/quantize_handlers.cc``)
instead of XLA's chain of reductions, the scalar scale rule and the cast
(per tensor), or its block amax, E8M0 code and scaled cast (MX): a smaller
program, which compiles faster (benchmarks/RESULTS.md, "Native CPU
quantize"). Every other platform lowers the XLA form, which XLA:GPU fuses into the
GEMM (``lax.platform_dependent`` keeps only the branch of the lowering
platform; where no GPU can be the target, only the CPU branch is traced).

The CPU branch takes the kernel only when all of these hold, else XLA's form:

* the native CPU library is loaded with these targets (`qlayers._native`);
* the process sees one device (a custom call has no partitioning rule: on a
  mesh its operand would be gathered to every device);
* round to nearest even and an fp8 payload: per tensor with Transformer
  Engine's scale rule (E4M3/E5M2 or their FNUZ variants), or MX blocks
  (E4M3/E5M2, RCEIL or FLOOR codes) of a 2-D operand along either axis;
* a non-empty float32/bfloat16/float16 input;
* ``QLAYERS_NATIVE_QUANTIZE`` is not ``0`` and the ``xla`` backend is not
  forced (``QLAYERS_BACKEND=xla`` or ``backend="xla"``).

`quantize_delayed` is one use of a delayed-scaling role (the amax
`qlayers.scaling.delayed_amax` chooses, then `quantize`) in one kernel, for
the per-tensor specs above, the ``max`` history algorithm and a 1-D history
(`fuses_delayed`). `dequantize` takes the kernel for a 2-D MX fp8 `QTensor`
under the same switches (`dequantizes`), and `end_step` (the end of a step
for many delayed-scaling roles at once) for 1-D FP32 histories.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from qlayers import native_quantize, scaling
  >>> spec = scaling.QuantSpec(format="e4m3", granularity="tensor")
  >>> x = jnp.linspace(-3.0, 5.0, 64).reshape(8, 8)
  >>> q = jax.jit(lambda x: native_quantize.quantize(x, spec))(x)
  >>> r = scaling.quantize(x, spec)
  >>> bool((q.payload == r.payload).all()), bool(q.scale == r.scale)
  (True, True)
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import scaling
from qlayers.scaling import QTensor, QuantSpec

__all__ = ["amax", "history_max", "quantize", "quantize_delayed",
           "dequantize", "end_step", "applies", "fuses_delayed",
           "dequantizes"]

_TARGETS = ("qlayers_amax", "qlayers_max_f32", "qlayers_quantize_fp8_tensor",
            "qlayers_quantize_mx", "qlayers_dequantize_mx",
            "qlayers_quantize_fp8_delayed", "qlayers_end_step")
_INPUTS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
           jnp.dtype(jnp.float16))
_FP8 = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2,
                                    jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz))


def _native():
  try:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return _native


def _per_platform(*args, cpu, default):
  """``lax.platform_dependent(*args, cpu=cpu, default=default)``, or
  ``cpu(*args)`` alone where no GPU can be the target
  (`qlayers.dispatch.targets_gpu`): there the program is lowered for CPU
  only, and the XLA branch would be traced just to be dropped (one trace of
  the XLA form per native call saved)."""
  from qlayers import dispatch  # pylint: disable=g-import-not-at-top
  if not dispatch.targets_gpu():
    return cpu(*args)
  return lax.platform_dependent(*args, cpu=cpu, default=default)


def _enabled(backend: str | None) -> tuple[bool, str]:
  value = os.environ.get("QLAYERS_NATIVE_QUANTIZE", "1").strip().lower()
  if value not in ("0", "1", "false", "true", "off", "on"):
    raise ValueError(f"QLAYERS_NATIVE_QUANTIZE must be 0/1 (or off/on), got "
                     f"{value!r}.")
  if value in ("0", "false", "off"):
    return False, "QLAYERS_NATIVE_QUANTIZE=0"
  if (backend or os.environ.get("QLAYERS_BACKEND")) == "xla":
    return False, "the xla backend is forced"
  native = _native()
  if native is None or not all(t in native.loaded("cpu") for t in _TARGETS):
    return False, "the native CPU library is not loaded"
  if jax.device_count() != 1:
    return False, "more than one device (the kernels have no partitioning rule)"
  return True, ""


def _input_ok(x) -> bool:
  return jnp.dtype(x.dtype) in _INPUTS and x.size > 0


def applies(x, spec: QuantSpec | None = None, backend: str | None = None
            ) -> tuple[bool, str]:
  """Whether the CPU branch of `quantize` (``spec`` given) or `amax` runs the
  native kernel for ``x``, and if not, why."""
  ok, why = _enabled(backend)
  if not ok:
    return ok, why
  if not _input_ok(x):
    return False, f"input {x.dtype}{tuple(x.shape)} (needs a non-empty float)"
  if spec is None:
    return True, "native amax"
  if spec.stochastic:
    return False, "stochastic rounding"
  if spec.fmt.dtype is None or jnp.dtype(spec.fmt.dtype) not in _FP8:
    return False, f"format {spec.fmt.name} (not fp8)"
  if spec.granularity == "tensor" and spec.scale_rule == "te":
    return True, "native per-tensor fp8 quantize"
  if (spec.granularity == "mx" and x.ndim == 2
      and jnp.dtype(spec.fmt.dtype) in _FP8[:2]):
    return True, "native MX fp8 quantize"
  return False, (f"{spec.granularity} granularity, {spec.scale_rule} rule, "
                 f"rank {x.ndim}")


def amax(x: jax.Array, *, backend: str | None = None) -> jax.Array:
  """`qlayers.scaling.amax` (max |x| as FP32, +Inf for any Inf or NaN)."""
  if not applies(x, None, backend)[0]:
    return scaling.amax(x)
  # Zero derivative, as XLA's form (integer bit operations) has.
  return _per_platform(lax.stop_gradient(x), cpu=_native().amax,
                       default=scaling.amax)


def history_max(history: jax.Array, *, backend: str | None = None
                ) -> jax.Array:
  """``jnp.max(history)`` of a 1-D FP32 amax history (NaN if it holds one):
  `qlayers.scaling.history_amax` with ``algo="max"``."""
  if (history.ndim != 1 or jnp.dtype(history.dtype) != jnp.float32
      or not applies(history, None, backend)[0]):
    return scaling.history_amax(history, "max")
  return _per_platform(
      lax.stop_gradient(history), cpu=_native().max_f32,
      default=lambda h: scaling.history_amax(h, "max"))


def quantize(x: jax.Array, spec: QuantSpec, axis: int = -1, *,
             tensor_amax: jax.Array | None = None,
             backend: str | None = None) -> QTensor:
  """`qlayers.scaling.quantize` of ``x`` (no stochastic-rounding key: where
  the spec rounds stochastically this is XLA's form and needs ``key``).

  The payload and scale have a zero derivative: qlayers differentiates
  around quantization (custom VJPs, straight-through estimators), never
  through it.
  """
  if not applies(x, spec, backend)[0]:
    return scaling.quantize(x, spec, axis, tensor_amax=tensor_amax)

  axis = scaling._normalize_axis(axis, x.ndim)  # pylint: disable=protected-access
  fmt = spec.fmt
  if spec.granularity == "mx":
    if tensor_amax is not None:
      raise ValueError("tensor_amax applies to per-tensor granularity only.")
    return _quantize_mx(x, spec, axis)
  given = () if tensor_amax is None else (jnp.asarray(tensor_amax,
                                                      jnp.float32),)

  def xla(x, *given):
    return scaling.quantize(x, spec, axis,
                            tensor_amax=given[0] if given else None)

  def cpu(x, *given):
    native = _native()
    a = given[0] if given else native.amax(x)
    payload, scale = native.quantize_fp8_tensor(
        x, a, fmt.dtype, margin=spec.margin, pow2=spec.pow2)
    return QTensor(payload, scale, fmt.name, spec.granularity, None, axis,
                   tuple(x.shape))

  return _per_platform(
      *map(lax.stop_gradient, (x, *given)), cpu=cpu, default=xla)


def fuses_delayed(x, spec: QuantSpec, history, algo: str = "max",
                  backend: str | None = None) -> bool:
  """Whether the CPU branch of `quantize_delayed` is the one native kernel."""
  return (algo == "max" and spec.granularity == "tensor"
          and jnp.ndim(history) == 1 and jnp.size(history) > 0
          and applies(x, spec, backend)[0])


def quantize_delayed(x: jax.Array, spec: QuantSpec, history: jax.Array,
                     running: jax.Array, axis: int = -1, *,
                     algo: str = "max", backend: str | None = None
                     ) -> tuple[QTensor, jax.Array, jax.Array]:
  """One use of a delayed-scaling role: ``x`` quantized with the amax that
  `qlayers.scaling.delayed_amax` chooses from ``history`` and the step's
  ``running`` amax, in one pass where `fuses_delayed` holds.

  Returns:
    ``(quantized x, amax its scale came from, running amax with max |x|
    folded in)``: bit for bit ``delayed_amax(ScaleState(history, running),
    scaling.amax(x), algo)`` and ``scaling.quantize(x, spec, axis,
    tensor_amax=...)``. No derivative flows through any of them.
  """
  axis = scaling._normalize_axis(axis, x.ndim)  # pylint: disable=protected-access

  def xla(x, history, running):
    state = scaling.ScaleState(history, running)
    use, run = scaling.delayed_amax(state, scaling.amax(x), algo)
    return scaling.quantize(x, spec, axis, tensor_amax=use), use, run

  args = tuple(map(lax.stop_gradient, (x, history, running)))
  if not fuses_delayed(x, spec, history, algo, backend):
    return xla(*args)
  fmt = spec.fmt

  def cpu(x, history, running):
    payload, scale, use, run = _native().quantize_fp8_delayed(
        x, history, running, fmt.dtype, margin=spec.margin, pow2=spec.pow2)
    return (QTensor(payload, scale, fmt.name, spec.granularity, None, axis,
                    tuple(x.shape)), use, run)

  return _per_platform(*args, cpu=cpu, default=xla)


def _quantize_mx(x, spec: QuantSpec, axis: int) -> QTensor:
  block = scaling.block_shape(x.shape, spec, axis)

  def xla(x):
    return scaling.quantize(x, spec, axis)

  def cpu(x):
    payload, codes = _native().quantize_mx(
        x, spec.fmt.dtype, axis=axis, block=spec.block_size,
        rule=spec.scale_rule)
    return QTensor(payload, codes, spec.fmt.name, spec.granularity, block,
                   axis, tuple(x.shape))

  return _per_platform(lax.stop_gradient(x), cpu=cpu, default=xla)


def dequantizes(q, backend: str | None = None) -> bool:
  """Whether the CPU branch of `dequantize` runs the native kernel for ``q``."""
  if (not isinstance(q, QTensor) or q.granularity != "mx"
      or q.payload.ndim != 2 or q.payload.size == 0
      or jnp.dtype(q.payload.dtype) not in _FP8[:2]):
    return False
  bs = q.block[q.axis]
  if q.block != ((bs, 1) if q.axis == 0 else (1, bs)):
    return False
  return _enabled(backend)[0]


def dequantize(q: QTensor, *, transpose: bool = False,
               backend: str | None = None, cpu_only: bool = False
               ) -> jax.Array:
  """``q.dequantize(jnp.bfloat16)`` (its transpose with ``transpose``) of a
  2-D MX fp8 operand, in one native pass where `dequantizes` holds (XLA's
  form otherwise). The result has a zero derivative, as the payload has.

  ``cpu_only``: the caller is itself a CPU-only branch (the CPU GEMM forms
  of `qlayers.dispatch`), so the kernel is called without a platform branch
  of its own (one form traced instead of two).
  """
  def xla(payload, codes):
    out = dataclasses.replace(q, payload=payload, scale=codes).dequantize(
        jnp.bfloat16)
    return out.T if transpose else out

  if not dequantizes(q, backend):
    return xla(q.payload, q.scale)

  def cpu(payload, codes):
    return _native().dequantize_mx(payload, codes, q.shape, axis=q.axis,
                                   block=q.block[q.axis], transpose=transpose)

  args = tuple(map(lax.stop_gradient, (q.payload, q.scale)))
  if cpu_only:
    return cpu(*args)
  return _per_platform(*args, cpu=cpu, default=xla)


def _plain_f32(v, ndim: int) -> bool:
  return (jnp.ndim(v) == ndim and jnp.dtype(v.dtype) == jnp.float32
          and jnp.size(v) > 0)


def end_step(states: list[scaling.ScaleState], gradient_amaxes=(), *,
             backend: str | None = None
             ) -> tuple[list[jax.Array], list[jax.Array]]:
  """`qlayers.scaling.update_scales` for every state, the first
  ``len(gradient_amaxes)`` after folding a gradient amax into the running
  one (``max``, a non-finite one read as 0) as `qlayers.update_scales`
  does: one native call for all of them where the kernel applies (1-D FP32
  histories, FP32 scalars), XLA's per-role form otherwise.

  Returns:
    ``(histories, amaxes)``: the new histories and the cleared running
    amaxes (zeros; on CPU written by the kernel, which spares XLA a copy of
    a zero per role where they are a step's outputs).
  """
  histories = [st.amax_history for st in states]
  amaxes = [st.amax for st in states]
  grads = list(gradient_amaxes)
  n, k = len(histories), len(grads)

  def xla(histories, amaxes, grads):
    new = []
    for i, (h, a) in enumerate(zip(histories, amaxes)):
      if i < len(grads):
        a = scaling.merge_amax(a, grads[i])
      new.append(scaling.update_scales(scaling.ScaleState(h, a)))
    return ([st.amax_history for st in new], [st.amax for st in new])

  if not (states and k <= n and _enabled(backend)[0]
          and all(_plain_f32(h, 1) for h in histories)
          and all(_plain_f32(a, 0) for a in amaxes + grads)):
    return xla(histories, amaxes, grads)

  def split(fn):
    def run(*flat):
      new, cleared = fn(list(flat[:n]), list(flat[n:2 * n]),
                        list(flat[2 * n:2 * n + k]))
      return list(new) + list(cleared)
    return run

  out = _per_platform(
      *map(lax.stop_gradient, histories + amaxes + grads),
      cpu=split(_native().end_step), default=split(xla))
  return list(out[:n]), list(out[n:])
