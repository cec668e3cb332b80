"""The GEMM plan: which operand copies and which kernel form each GEMM of a
quantized matmul runs, decided once per matmul (`plan`).

Every backend takes the same contract: two operands, each a `QTensor`
(payload + scales + layout) or a plain wide array, contracted over their
``axis``, and returns the wide product with FP32 accumulation.

* ``xla``: plain JAX, in the form XLA turns into the best kernel it has on
  the platform (a *form* is one way of writing the GEMM, see `FORMS`).
* ``ffi``: native kernels from ``ffi/`` through XLA FFI (see `qlayers._native`).

The choice is made for the platform the program is *lowered* for, not the
host's ``jax.default_backend()``: `run` traces one branch per distinct
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

``QLAYERS_BACKEND=xla|ffi`` (or the ``backend=`` argument of the layers and
ops) forces a backend: one input of the plan, like the others.

Under a mesh with auto axes, quantized GEMMs run through `qlayers.partition`
(each device its local GEMM; FSDP weights gathered as payloads): always for
``ffi``, and for ``xla`` unless traced inside
``qlayers.sharding.gather_payloads(False)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import _native
from qlayers import partition
from qlayers import scaling
from qlayers import sharding
from qlayers.forms import FORMS, scaled_dot_mx  # noqa: F401  (re-exported)
from qlayers.recipe import Recipe
from qlayers.scaling import QTensor, QuantSpec
# The capability table, re-exported: one name space for the GEMM's route.
from qlayers.table import (  # noqa: F401
    BACKENDS, PLATFORMS, TABLE, Choice, Rule, _host_platform, _requested,
    _tn_view, check_backend, choose, gpu_arch, prefers_contraction_last,
    select, target_arch, targets_gpu)

__all__ = ["plan", "Plan", "Gemm", "Operand", "run", "gemm", "select",
           "choose", "report", "target_arch", "gpu_arch", "TABLE", "FORMS",
           "BACKENDS", "PLATFORMS"]
# ----------------------------------------------------------------------------
# The plan of one quantized matmul


@dataclasses.dataclass(frozen=True)
class Operand:
  """How a GEMM operand is made from its wide 2-D tensor: Hadamard-transformed
  along ``axis`` (``hadamard``: the block size, 0 for none), then quantized
  by ``spec`` along ``axis`` -- of its transpose (``tn``, contraction-last:
  packed formats, and any operand of a forced native backend) -- or, without
  a ``spec``, cast to the recipe's compute dtype."""

  spec: QuantSpec | None
  axis: int
  tn: bool = False
  hadamard: int = 0

  @classmethod
  def make(cls, spec: QuantSpec | None, axis: int, hadamard: int = 0,
           backend: str | None = None) -> "Operand":
    """The operand of ``spec`` along ``axis``, contraction-last where its
    format is packed or the forced ``backend`` wants TN operands."""
    tn = spec is not None and axis != 1 and (
        spec.fmt.packed or prefers_contraction_last(spec.granularity,
                                                    backend))
    return cls(spec, axis, tn, hadamard)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM of a plan: its two operands (contracted over their ``axis``),
  the `Choice` per lowering platform, whether it runs through the
  partitioning rule (`qlayers.partition`: each device its local GEMM, by
  the name ``local`` of `register_local`), and its output dtype."""

  lhs: Operand
  rhs: Operand
  choices: tuple[tuple[str, Choice], ...]
  partitioned: bool
  local: str
  out_dtype: Any

  @property
  def axes(self) -> tuple[int, int]:
    """The contraction axes of the operands as made (1 where ``tn``)."""
    return tuple(1 if op.tn else op.axis for op in (self.lhs, self.rhs))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything decided for one quantized ``x (M, K) @ w (K, N)``.

  ``fprop`` is ``x @ w``, ``dgrad`` ``g @ w.T``, ``wgrad`` ``x.T @ g``.
  ``save_x``: what Fprop keeps for Wgrad (``"fprop"``: its own copy of x,
  ``"wgrad"``: a copy quantized for Wgrad now, ``"wide"``: x itself);
  ``share_w``: Dgrad reuses Fprop's copy of w; ``share_g``: Wgrad reuses
  Dgrad's copy of g (an axis-free per-tensor copy serves both GEMMs).
  """

  recipe: Recipe
  backend: str | None
  fprop: Gemm
  dgrad: Gemm
  wgrad: Gemm
  save_x: str
  share_w: bool
  share_g: bool

  @property
  def dequantized(self) -> dict[str, tuple[bool, bool]]:
    """Per role (``x``, ``w``, ``g``), which of its two copies (as
    `qlayers.operands.operand_pair` orders them: x for Fprop, Wgrad; w for
    Dgrad, Fprop; g for Dgrad, Wgrad) hold their BF16 dequantized values
    (`qlayers.scaling.dequantized`): those read at once by GEMMs that read
    nothing else (`reads_bf16`: MX without MX tensor cores). The copies
    kept for the backward pass (x's for Wgrad, w's for Dgrad) stay
    quantized, for their memory."""
    return {"x": (reads_bf16(self.fprop), False),
            "w": (False, reads_bf16(self.fprop)),
            "g": (reads_bf16(self.dgrad), reads_bf16(self.wgrad))}


def plan(recipe: Recipe, x_shape, x_dtype, w_shape, out_dtype, *,
         backend: str | None = None) -> Plan:
  """The `Plan` of ``x (..., K) @ w (K, N)`` under ``recipe``.

  It reads everything that decides a GEMM once: the recipe, the forced
  backend (``backend``, else ``$QLAYERS_BACKEND``), the platforms the
  program may be lowered for and their GPU generation (`targets_gpu`,
  `gpu_arch`), the native libraries loaded, the operand shapes and dtypes
  and the mesh being traced under.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> p = plan(qlayers.recipe("mxfp8"), (4, 64), jnp.float32, (64, 32),
    ...          jnp.float32)
    >>> dict(p.fprop.choices)["cpu"].form, p.share_w
    ('cpu_mx', False)
  """
  requested = _requested(backend)
  targets = tuple((p, gpu_arch(p)) for p in PLATFORMS)
  lowered = PLATFORMS if targets_gpu() else ("cpu",)
  mesh = sharding.auto_mesh() is not None and not sharding.unpartitioned_now()
  gather = mesh and sharding.quantized_gather()
  libraries = tuple(_native.loaded(p) for p in ("cpu", "cuda", "rocm"))
  m = math.prod(x_shape[:-1])
  if not isinstance(m, int):
    # A symbolic batch (jax.export): the native kernels' shape limits cannot
    # be checked on it, so plan as for one row, which the table's XLA forms
    # take at any size.
    m = 1
  return _plan(recipe, requested, targets, lowered, mesh, gather, libraries,
               (m, w_shape[0], w_shape[1]), jnp.dtype(x_dtype),
               jnp.dtype(out_dtype))


def _abstract(op: Operand, shape: tuple[int, int]):
  """The shapes and metadata of ``op`` made from a ``shape`` tensor."""
  if op.spec is None:
    return jax.ShapeDtypeStruct(shape, jnp.float32)
  key = jax.random.key(0) if op.spec.stochastic else None
  t = jax.ShapeDtypeStruct(shape[::-1] if op.tn else shape, jnp.float32)
  q = jax.eval_shape(lambda t: scaling.quantize(
      t, op.spec, 1 if op.tn else op.axis, key=key), t)
  return dataclasses.replace(q, transposed=op.tn)


def _pow2(a: QuantSpec | None, b: QuantSpec | None) -> bool:
  """Both operands have tile/block scales that are powers of two (UE8M0):
  the table's ``pow2`` rows apply."""
  return all(s is not None and s.pow2 and s.granularity in ("tile", "block")
             for s in (a, b))


def _local_name(requested: str | None, pow2: bool) -> str:
  """The registered local GEMM of `qlayers.partition` for a plan's GEMM."""
  return (requested or "default") + ("_pow2" if pow2 else "")


def _shares(a: QuantSpec | None, b: QuantSpec | None, requested) -> bool:
  """One quantized copy serves both specs: an axis-free scale (per tensor,
  or square 2-D blocks, which quantize ``t`` and ``t.T`` to the same values:
  DeepSeek-V3's 128 x 128 weight blocks), in a layout the backend takes for
  both GEMMs. Packed FP6/FP4 payloads are packed along one axis, so a 2-D
  block copy of them is not shared."""
  return (a is not None and a == b and not a.stochastic
          and (a.granularity == "tensor"
               or (a.granularity == "block" and not a.fmt.packed))
          and not prefers_contraction_last(a.granularity, requested))


# Keyed only on its arguments, all explicit values (the loaded native
# libraries among them, so a library loaded later is seen).
@functools.lru_cache(maxsize=512)
def _plan(recipe: Recipe, requested, targets, lowered, mesh: bool,
          gather: bool, libraries, mkn, x_dtype, out_dtype) -> Plan:
  del libraries
  m, k, n = mkn
  f, d, w = recipe.fprop, recipe.dgrad, recipe.wgrad

  def op(spec, axis, hadamard=0):
    return Operand.make(spec, axis, hadamard, requested)

  def gemm(lhs, rhs, shapes, out):
    a, b = _abstract(lhs, shapes[0]), _abstract(rhs, shapes[1])
    pow2 = _pow2(lhs.spec, rhs.spec)
    every = {p: choose(a, b, p, arch, backend=requested, pow2=pow2)
             for p, arch in targets}
    partitioned = isinstance(a, QTensor) and mesh and (
        gather or any(c.backend == "ffi" for c in every.values()))
    return Gemm(lhs, rhs, tuple((p, every[p]) for p in lowered),
                partitioned, _local_name(requested, pow2), jnp.dtype(out))

  save_x = "wide"
  if recipe.save_quantized_wgrad_input and w.lhs is not None:
    save_x = ("fprop" if _shares(f.lhs, w.lhs, requested) and not w.hadamard
              else "wgrad")
  return Plan(
      recipe, requested,
      fprop=gemm(op(f.lhs, 1), op(f.rhs, 0), ((m, k), (k, n)), out_dtype),
      dgrad=gemm(op(d.lhs, 1, d.hadamard), op(d.rhs, 1, d.hadamard),
                 ((m, n), (k, n)), d.out_dtype or x_dtype),
      wgrad=gemm(op(w.lhs, 0, w.hadamard), op(w.rhs, 0, w.hadamard),
                 ((m, k), (m, n)), w.out_dtype or jnp.float32),
      save_x=save_x,
      share_w=_shares(f.rhs, d.rhs, requested) and not d.hadamard,
      share_g=(_shares(d.lhs, w.rhs, requested)
               and not (w.hadamard or d.hadamard)))


# ----------------------------------------------------------------------------
# Running a GEMM


# Forms that read nothing of their operands but ``dequantize(bfloat16)``.
_BF16_READERS = frozenset({"bf16_dequant", "cpu_mx"})


def reads_bf16(*gemms: Gemm) -> bool:
  """Whether every form of ``gemms``, on every platform lowered for, reads
  only its operands' BF16 dequantized values (MX without MX tensor cores):
  a copy they share can then hold just those (`scaling.dequantized`).

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> p = plan(qlayers.recipe("mxfp8"), (4, 64), jnp.float32, (64, 32),
    ...          jnp.float32)
    >>> reads_bf16(p.fprop, p.wgrad)  # CPU only: the BF16 emulation
    True
  """
  return all(c.form in _BF16_READERS for g in gemms for _, c in g.choices)


def run(step: Gemm, a, b) -> jax.Array:
  """One GEMM of a `Plan` on its 2-D operands (`QTensor` or wide arrays):
  ``(free dim of a, free dim of b)`` in ``step.out_dtype``, FP32
  accumulation. A per-tensor or square-block copy made for another GEMM of
  the plan is relabelled to this one's contraction axis (its scales do not
  depend on the axis)."""
  a, b = (dataclasses.replace(q, axis=axis)
          if isinstance(q, QTensor) and q.axis != axis else q
          for q, axis in zip((a, b), step.axes))
  if step.partitioned:
    return partition.gemm(a, b, step.axes, step.out_dtype, step.local)
  forms = tuple((p, c.form) for p, c in step.choices)
  if len({form for _, form in forms}) == 1:
    return _JITTED[forms[0][1]](a, b, step.out_dtype, step.axes)
  return _branches(forms, a, b, step.axes, step.out_dtype)


# Each form jitted with its output dtype and axes static: a train step runs
# the same GEMM signatures in every layer, and jit traces and lowers each
# once (inlined into the caller's program, which compiles the same).
_JITTED = {name: jax.jit(fn, static_argnums=(2, 3))
           for name, fn in FORMS.items()}


def _branches(forms, a, b, axes, out_dtype) -> jax.Array:
  """One traced branch per distinct form; ``lax.platform_dependent`` keeps
  the lowering platform's (a single form is called as it is)."""
  fns: dict[str, Callable] = {}
  for _, form in forms:
    fns.setdefault(form, functools.partial(
        lambda form, a, b: _JITTED[form](a, b, out_dtype, axes), form))
  if len(fns) == 1:
    return next(iter(fns.values()))(a, b)
  return lax.platform_dependent(
      a, b, **{p: fns[form] for p, form in forms})


def gemm(a, b, *, axes: tuple[int, int], out_dtype,
         backend: str | None = None, pow2: bool = False) -> jax.Array:
  """Product of two given 2-D operands contracted over ``axes``.

  ``a`` and ``b`` are both `QTensor` (quantized along their contraction axis)
  or both plain arrays; the form is chosen per platform from `TABLE` (one
  branch traced per distinct choice; ``pow2``: their tile/block scales are
  powers of two, see `choose`). The GEMMs of a quantized matmul run
  through their `Plan` instead (`run`); this is the same choice for
  operands made elsewhere, and the local GEMM of `qlayers.partition`.
  """
  if isinstance(a, QTensor) != isinstance(b, QTensor):
    raise TypeError("gemm operands must both be QTensor or both be arrays.")
  if isinstance(a, QTensor) and (a.axis, b.axis) != tuple(axes):
    raise ValueError(f"operands were quantized along axes {(a.axis, b.axis)}"
                     f" but the GEMM contracts {tuple(axes)}.")
  platforms = PLATFORMS if targets_gpu() else ("cpu",)
  forms = tuple((p, choose(a, b, p, gpu_arch(p), backend=backend,
                          pow2=pow2).form) for p in platforms)
  return _branches(forms, a, b, tuple(axes), jnp.dtype(out_dtype))


# The partitioning rule calls the local GEMM by name (a hashable static
# argument): the forced backend, or "default" for the table's choice, and
# "_pow2" where the operands' tile/block scales are powers of two.
for _name in ("default",) + BACKENDS:
  for _pow in (False, True):
    partition.register_local(
        _local_name(_name, _pow), functools.partial(
            lambda backend, pow2, a, b, axes, out_dtype: gemm(
                a, b, axes=axes, out_dtype=out_dtype, backend=backend,
                pow2=pow2),
            None if _name == "default" else _name, _pow))


# ----------------------------------------------------------------------------
# Report

# Targets `report` describes: (platform, architecture).
REPORT_TARGETS = (("cpu", None), ("cuda", "sm_90"), ("cuda", "sm_100"),
                  ("rocm", "gfx942"), ("rocm", "gfx950"))


def _recipe_choices(recipe, platform: str, arch: str | None) -> dict:
  """Backend, form and reason per GEMM of a recipe on a 256x256 layer."""
  out = {}
  for name, gemm_recipe, axes in (("fprop", recipe.fprop, (1, 0)),
                                  ("dgrad", recipe.dgrad, (1, 1)),
                                  ("wgrad", recipe.wgrad, (0, 0))):
    lhs, rhs = gemm_recipe.lhs, gemm_recipe.rhs
    if lhs is None:
      wide = choose(None, None, platform, arch)  # the wide form there
      out[name] = {"backend": wide.backend, "form": wide.form,
                   "why": "unquantized"}
      continue
    def q(spec, axis):
      last = spec.fmt.packed or prefers_contraction_last(spec.granularity)
      return _abstract(Operand(spec, axis, axis != 1 and last), (256, 256))
    qa, qb = q(lhs, axes[0]), q(rhs, axes[1])
    try:
      c = choose(qa, qb, platform, arch, pow2=_pow2(lhs, rhs))
      out[name] = {"backend": c.backend, "form": c.form, "why": c.why}
    except ValueError as e:  # a forced backend that cannot run it
      out[name] = {"backend": "error", "form": "", "why": str(e)}
  return out


def report() -> dict:
  """What is available, and which backend each named recipe's GEMMs use.

  ``chosen`` is for the host platform and its Fprop; ``targets`` has every
  GEMM of every recipe for each of `REPORT_TARGETS` (``"cuda sm_90"``, ...).

  Example:
    >>> import qlayers
    >>> info = qlayers.backends()
    >>> sorted(info)
    ['available', 'chosen', 'ffi_build', 'forced', 'platform', 'targets']
    >>> info["targets"]["cuda sm_100"]["mxfp8"]["fprop"]["form"]
    'mx_cudnn'
  """
  from qlayers.recipe import available_recipes, recipe as load  # pylint: disable=g-import-not-at-top
  gpu_arch("cuda")  # a bad $QLAYERS_GPU_ARCH fails here as in every GEMM
  ffi_ok = _native.available()
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
  return {
      "platform": host,
      "available": {"xla": True, "ffi": ffi_ok},
      "ffi_build": _native.build_info(),
      "forced": os.environ.get("QLAYERS_BACKEND"),
      "chosen": chosen,
      "targets": targets,
  }
