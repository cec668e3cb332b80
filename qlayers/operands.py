"""How each operand of a quantized GEMM is made from its wide tensor (no
Flax): `operand` (rows, Hadamard transform, `scaling.quantize` in the
layout a `dispatch.Operand` says) and `delayed_amax` (the amax a delayed
role scales by). `qlayers.gemm` runs them inside the GEMM's custom_vjp;
`qlayers.inspect` rebuilds the same copies with them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from qlayers import blocks
from qlayers import cast_transpose
from qlayers import formats
from qlayers import hadamard
from qlayers import partition
from qlayers import scale_rules
from qlayers import scaling
from qlayers import sharding
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import ScaleState

__all__ = ["operand", "operand_pair", "pairable", "delayed_amax",
           "stored_operand", "requantized_operand", "fake_quant_matmul"]


def delayed_amax(t, state: ScaleState, recipe: Recipe):
  """(amax to scale ``t`` by now, updated running amax) for one delayed role
  (`scaling.delayed_amax` of the whole tensor's amax)."""
  current = sharding.global_amax(scaling.amax(t), t)
  return scaling.delayed_amax(state, current, recipe.amax_compute_algo)


def _rows(t):
  """``t (..., K)`` as ``(M, K)``."""
  return t if t.ndim == 2 else t.reshape(-1, t.shape[-1])


def _data_key(t):
  """A PRNG key derived from the bits of 2-D ``t`` (for stateless callers):
  the sum of its row sums. XLA rewrites a whole-array sum of a reshape into
  one over the caller's leading dims, which adds in another order (so ``x
  (B, S, K)`` and its rows would round apart); the row sums are the same
  either way, and behind a barrier (on a vector, so the row sums still
  fuse with ``t``'s producer) they are summed as one vector."""
  rows = jnp.sum(t.astype(jnp.float32), axis=1)
  total = jnp.sum(lax.optimization_barrier(rows))
  return jax.random.key(lax.bitcast_convert_type(total, jnp.uint32))


def _device_key(key, t):
  """``key`` for stochastic rounding of ``t``: inside ``shard_map``, where
  ``t`` is this device's part, folded with the device's index over the
  manual axes ``t`` varies over. The bits are drawn by each element's place
  in the array rounded (`qlayers.threefry`), and every device's part starts
  at place 0: with one key the devices would draw the same bits (rounding
  errors alike across data-parallel shards, not independent)."""
  axes = sharding.varying_axes(t)
  return jax.random.fold_in(key, lax.axis_index(axes)) if axes else key


def operand(t: jax.Array, op: Operand, *, amax=None, key=None,
            dtype=jnp.float32, gather: tuple[str, ...] = ()):
  """The GEMM operand ``op`` (from a `dispatch.Plan`) made of ``t (..., C)``.

  The rows ``(M, C)`` of ``t``, Hadamard-transformed and quantized with
  `scaling.quantize` as ``op`` says (``amax``: the per-tensor amax to scale
  by; ``key``: stochastic rounding, derived from the data when omitted;
  inside ``shard_map`` folded with the device's index, `_device_key`), or
  cast to ``dtype`` where ``op`` has no spec. Inside ``shard_map`` a
  per-tensor scale is the whole tensor's. ``gather``: manual axes over
  which 2-D ``t`` is a shard along dim 0 (an FSDP weight,
  `sharding.gathered_weights`): the operand of the whole tensor, quantized
  on the shard and gathered as payload + scales (`partition.gather`), or
  gathered wide first where a shard would not quantize as the whole does.

  An elementwise quantization (per tensor, in the layout given) is made of
  ``t`` itself and only its payload is flattened, so the GEMM's reshape does
  not sit between the caller's ops and the quantize chain.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("mxfp8").fprop.lhs
    >>> operand(jnp.ones((2, 3, 64)), Operand(spec, 1)).payload.shape
    (6, 64)
  """
  spec = op.spec
  if key is not None and spec is not None and spec.stochastic:
    key = _device_key(key, t)
  if gather:
    return _gathered(t, op, gather, amax=amax, key=key, dtype=dtype)
  if spec is None:
    return _rows(t.astype(dtype))
  elementwise = (t.ndim > 2 and spec.granularity == "tensor"
                 and not (op.tn or spec.stochastic or op.hadamard))
  if not spec.stochastic:
    key = None
  elif key is None:  # of the rows as given (a transform would cost a pass)
    key = _data_key(_rows(t))
  if not elementwise:
    t = _rows(t)
    if op.hadamard:
      t = _transformed(t, op.hadamard, op.axis)
  per_tensor = spec.granularity == "tensor" or spec.scale_rule == "nvfp4"
  if amax is None and per_tensor and sharding.varying_axes(t):
    amax = sharding.global_amax(scaling.amax(t), t)
  if elementwise:
    q = scaling.quantize(t, spec, -1, amax=amax)
    rows = _rows(q.payload)
    return dataclasses.replace(q, payload=rows, axis=op.axis, shape=rows.shape)
  if op.tn:
    q = scaling.quantize(t.T, spec, 1, amax=amax, key=key)
    return dataclasses.replace(q, transposed=True)
  return scaling.quantize(t, spec, op.axis, amax=amax, key=key)


def stored_operand(q: scaling.QTensor, op: Operand,
                   w_shape: tuple[int, int]) -> scaling.QTensor | None:
  """The weight operand ``op`` of a ``(K, N)`` weight, from its codes as
  stored: ``q``, ``(N, K)`` quantized along ``K`` (axis 1) by ``op``'s spec
  (a frozen kernel's, `qlayers.FrozenKernel.qtensor`). Where they are the
  fixed point of that quantization (`qlayers.freeze` stores them so) it is
  `operand`'s copy of their dequantized values bit for bit, without the
  wide pass (other codes, a checkpoint's, are used as they are); None
  where ``op`` takes another layout than ``q`` can give by a relabel or a
  transpose of its bytes (a Hadamard transform, stochastic rounding, FP4
  codes packed along the other axis, scales in another form).

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers import scaling
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("mxfp4").fprop.rhs
    >>> w = jnp.linspace(-1, 1, 64 * 32).reshape(64, 32)
    >>> q = scaling.quantize(w.T, spec, 1)
    >>> op = Operand.make(spec, 0)
    >>> s, made = stored_operand(q, op, w.shape), operand(w, op)
    >>> bool((s.payload == made.payload).all()), s.transposed
    (True, True)
  """
  spec = op.spec
  if (spec is None or op.hadamard or spec.stochastic or q.axis != 1
      or q.transposed or q.dequantized or q.shape != tuple(w_shape[::-1])):
    return None
  if op.tn:
    made = dataclasses.replace(q, transposed=True)
  elif op.axis != 0 or q.fmt.packed:  # packed along K: not transposable
    return None
  else:
    made = dataclasses.replace(
        q, payload=q.payload.T, scale=q.scale.T, axis=0,
        block=None if q.block is None else q.block[::-1],
        shape=tuple(w_shape))
  want = jax.eval_shape(lambda w: operand(w, op), jax.ShapeDtypeStruct(
      tuple(w_shape), jnp.float32))
  if jax.tree.structure(want) != jax.tree.structure(made) or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(made))):
    return None
  return made


def requantized_operand(q: scaling.QTensor, op: Operand
                        ) -> scaling.QTensor | None:
  """The operand ``op`` along axis 1 of a ``(K, N)`` weight (Dgrad's) from
  a stored copy ``q``, ``(N, K)`` along ``K`` (a frozen kernel's, as
  `stored_operand` takes it): `operand` of ``q``'s dequantized values,
  which an NVIDIA GPU makes from the codes in one pass (the same bits,
  without the FP32 weight written and read between): MX by
  `qlayers.cast_transpose.mx_requantize` (MXFP8 E4M3, MXFP6 and MXFP4 in
  blocks of 32; MXFP6's copy holds its values in E4M3, `scaling.widened`,
  as the pair kernel writes it), NVFP4's 16 x 16 blocks by
  `qlayers.cast_transpose.nvfp4_requantize` after XLA finds the
  dequantized tensor's amax. Under a mesh each device requantizes its
  shard (`qlayers.partition.cast`). None where those kernels do not take
  ``q`` and ``op`` (whole 32 x 32 tiles, on every device under a mesh, any
  split of either dim; rounded to nearest, no transform, no manual axes),
  or the program is not lowered for a GPU where the pair kernels run.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("mxfp8").dgrad.rhs
    >>> q = scaling.quantize(jnp.ones((64, 32)), spec, 1)
    >>> requantized_operand(q, Operand(spec, 1)) is None  # not for a GPU
    True
  """
  spec = op.spec
  if (spec is None or spec.stochastic or op.hadamard or op.tn or op.axis != 1
      or q.format != spec.fmt.name or q.granularity != spec.granularity
      or q.axis != 1 or q.transposed or q.dequantized
      or q.padded_shape != q.shape or not table.targets_gpu()
      or sharding.varying_axes(q.payload)):
    return None
  if sharding.context_mesh() is not None:
    # Under a mesh, where every device holds whole tiles of any split
    # (else the kernel's rule would gather the codes first); not inside
    # shard_map, whose local copy is not the whole weight's.
    mesh = sharding.auto_mesh()
    if mesh is None or any(n % (cast_transpose.MX_BLOCK
                                * math.prod(mesh.axis_sizes))
                           for n in q.shape):
      return None
  version = table.sm_version(table.gpu_arch("cuda"))
  nvfp4 = spec.scale_rule == "nvfp4"
  if nvfp4:
    n = cast_transpose.NV_BLOCK
    takes = (spec.granularity == "block" and q.block == (n, n)
             and q.tensor_scale is not None and version >= 90
             and cast_transpose.requantize_supported(q.shape, spec.fmt))
  else:
    takes = (spec.granularity == "mx"
             and spec.scale_rule in ("mx_rceil", "mx_floor")
             and q.block == (1, spec.block_size)
             and cast_transpose.requantize_supported(q.shape, spec.fmt)
             and _block_pairs(spec, version))
  if not takes:
    return None

  # MXFP6's copy holds its values in E4M3 (`scaling.widened`), as the
  # pair kernel writes it, on every platform: the branches agree.
  finish = scaling.widened if spec.fmt.bits == 6 else (lambda c: c)

  def xla(payload, scale):
    stored = dataclasses.replace(q, payload=payload, scale=scale)
    return finish(operand(stored.dequantize().T, op))

  def cuda(payload, scale):
    stored = finish(dataclasses.replace(q, payload=payload, scale=scale))
    if not nvfp4:
      return jax.tree.unflatten(tree, cast_transpose.mx_requantize(
          stored.payload, scale, spec.fmt, spec.scale_rule))
    # The tensor amax first (an XLA reduction of the codes' integer
    # maxima), then `_nvfp4_pair`'s two scale levels.
    amax = cast_transpose.nvfp4_amax(payload, scale)
    p, e4m3 = cast_transpose.nvfp4_requantize(payload, scale, amax)
    s_dec = scale_rules.rdivide_rn(1.0, scale_rules.nvfp4_encode_scale(amax))
    return jax.tree.unflatten(
        tree, [p, e4m3.astype(jnp.float32) * s_dec, e4m3, s_dec])

  made = jax.eval_shape(xla, q.payload, q.scale)
  tree = jax.tree.structure(made)
  if (tree.num_leaves != (4 if nvfp4 else 2)
      or jax.eval_shape(cuda, q.payload, q.scale) != made):
    return None
  return lax.platform_dependent(q.payload, q.scale, cuda=cuda, default=xla)


def _transformed(t, size: int, axis: int):
  """`hadamard.transform` of 2-D ``t``; where the program may run on an
  NVIDIA GPU, in one pass there (`qlayers.cast_transpose.transform`, the
  same bits), not in XLA's pass per butterfly stage. Not under an automatic
  mesh, where it is unmeasured (its partitioning rule serves programs
  sharded through ``jax.jit`` alone)."""
  def xla(t):
    return hadamard.transform(t, size, axis=axis)
  if not (table.targets_gpu() and sharding.auto_mesh() is None
          and cast_transpose.transform_supported(t.shape, size, axis)):
    return xla(t)
  return lax.platform_dependent(
      t, cuda=lambda t: cast_transpose.transform(t, size, axis), default=xla)


def pairable(t: jax.Array, last: Operand, first: Operand | None = None
             ) -> bool:
  """Whether `operand_pair` makes ``t``'s two copies in one pass here.

  One copy (``first`` None): per-tensor FP8 with Transformer Engine's scale
  rule (the one the kernel computes) where the program may run on an
  NVIDIA GPU with FP8 GEMMs, written in two layouts where that GEMM takes
  only contraction-minor operands (Ada, Hopper:
  `qlayers.table.fp8_gemm_transposes`) and in one on Blackwell, whose GEMM
  reads either; DeepSeek-V3's 128 x 128 blocks in two layouts.
  Two copies (``last`` along axis 1, ``first`` along axis 0, one spec):
  row-wise FP8 (TE's rule), MXFP8 with blocks of 32, DeepSeek-V3 tiles of
  128, MXFP4 and MXFP6 (their ``first`` the ``tn`` copy, of ``t.T``;
  MXFP6's payloads in E4M3, `scaling.widened`). Row-wise and block-scaled
  pairs on Hopper and Blackwell (`_block_pairs`); rows of whole tiles,
  round to nearest (MXFP4: or stochastic, and either copy of a Hadamard
  transform of up to 32 points); under a mesh, those `_partitioned` takes
  (each kernel has a partitioning rule, `qlayers.partition.cast`). NVFP4
  (from Hopper
  on): ``last`` along axis 1 and ``first`` the ``tn`` copy, optionally of
  the 16-point transform (1 x 16 tiles, x and g), or both of 16 x 16 blocks
  rounded to nearest (w).
  """
  spec = last.spec
  if (spec is None or last.tn
      or (last.hadamard and not (spec.fmt.bits == 4 and first is not None))
      or (spec.stochastic and spec.fmt.bits != 4)
      or not table.targets_gpu() or sharding.varying_axes(t)):
    return False
  rows = (math.prod(t.shape[:-1]), t.shape[-1])
  arch = table.gpu_arch("cuda")
  mesh = sharding.auto_mesh()
  if mesh is not None and not _partitioned(spec, first, arch, rows,
                                           math.prod(mesh.axis_sizes)):
    return False
  version = table.sm_version(arch)
  if spec.scale_rule == "nvfp4":
    return (first is not None and first.spec == spec and version >= 90
            and last.axis == 1 and first.axis == 0 and first.tn
            and first.hadamard in (0, cast_transpose.NV_BLOCK)
            and not (spec.granularity == "block"
                     and (first.hadamard or spec.stochastic))
            and cast_transpose.nvfp4_supported(rows))
  if first is None:
    if _square(spec):
      return (_block_pairs(spec, version)
              and cast_transpose.mx_supported(rows, spec.fmt,
                                              spec.block_size))
    return (spec.granularity == "tensor" and spec.scale_rule == "te"
            and version >= 89 and cast_transpose.supported(rows, spec.fmt))
  if spec.fmt.bits == 4:  # MXFP4: the copy along axis 0 is t.T's (tn)
    supported = (cast_transpose.fp4_supported(rows, spec.fmt,
                                              spec.block_size)
                 and cast_transpose.fp4_transforms((last.hadamard,
                                                    first.hadamard)))
  elif spec.granularity == "row":  # TE's rule per row and per column
    supported = (spec.scale_rule == "te" and not first.tn
                 and cast_transpose.supported(rows, spec.fmt))
  else:  # MXFP8, tiles; MXFP6 (its copy along axis 0 t.T's, in E4M3)
    supported = (cast_transpose.mx_supported(rows, spec.fmt, spec.block_size)
                 and not (last.hadamard or first.hadamard))
  return (first.spec == spec
          and (_block_rule(spec) is not None or spec.granularity == "row")
          and last.axis == 1 and first.axis == 0
          and first.tn == spec.fmt.packed
          and _block_pairs(spec, version) and supported)


def _partitioned(spec, first: Operand | None, arch: str | None,
                 rows: tuple[int, int], devices: int) -> bool:
  """Whether a pair's kernel runs under a mesh of ``devices``, where it
  pays (each has a partitioning rule, `qlayers.partition.cast`). The
  per-tensor one on every GPU with FP8 GEMMs: on Blackwell it writes one
  layout, and XLA cannot merge its calls on one tensor (q, k and v of one
  x), but XLA's own casts, fused into their producers (SwiGLU and its
  gradient), are bound by their instructions (8-GPU B200 8B block: 1.35x
  with them, 1.41x with the kernel; benchmarks/RESULTS.md). DeepSeek-V3's
  tiles and
  128 x 128 blocks from sm_90 on (FP8 copies, which the blockwise and
  block-scaled GEMMs read). The MX and MXFP6 pairs where block-scaled GEMMs
  are native (sm_100 on; on Hopper their copies are BF16 values, which FSDP
  would gather wider than XLA's FP8 ones), MXFP4's and NVFP4's there too,
  the row-wise pair from sm_90 on. All of these only if any split of
  ``rows`` over the mesh leaves whole blocks or tiles (else the rule would
  gather the wide tensor)."""
  if first is None:
    if not _square(spec):
      return spec.granularity == "tensor"
    blocks_of, native = (cast_transpose.TILE_BLOCK,) * 2, 90
  # Whole blocks (NVFP4's amax tiles of rows, row-wise's 64 x 64 tiles) on
  # every device.
  elif spec.granularity == "row":
    blocks_of, native = (cast_transpose.TILE,) * 2, 90
  else:
    blocks_of = (cast_transpose.nvfp4_tile_rows(rows[0])
                 if spec.scale_rule == "nvfp4" else spec.block_size,
                 spec.block_size)
    native = 90 if spec.scale_rule == "deepseek" else 100
  return (table.sm_version(arch) >= native
          and all(n % (b * devices) == 0 for n, b in zip(rows, blocks_of)))


def _block_pairs(spec, version: int) -> bool:
  """Whether block-scaled copies are made in one pass on ``sm_<version>``:
  on Hopper and Blackwell, feeding cuDNN's block-scaled GEMM, cuBLASLt's
  blockwise one, or (MXFP8 on Hopper) a BF16 GEMM on dequantized copies,
  which then reads the pair instead of quantizing twice. Not DeepSeek-V3
  scales that are not powers of two on Blackwell: no native GEMM takes
  them there, and an FP32 dequantize after the pair costs more bytes than
  the two quantizes it replaces (predicted 8B block 0.54x -> 0.53x)."""
  if version >= 100 and spec.granularity != "mx" and not spec.pow2:
    return False
  return version >= 90


def _square(spec) -> bool:
  """DeepSeek-V3 128 x 128 blocks (the weights of `deepseek_v3` and
  `deepseek_v3_ue8m0`): one copy for both GEMMs, in both layouts by
  `qlayers.cast_transpose.block_cast_transpose`."""
  return (spec.granularity == "block" and spec.scale_rule == "deepseek"
          and spec.block_size == cast_transpose.TILE_BLOCK)


def _block_rule(spec) -> str | None:
  """The `qlayers.cast_transpose.mx_cast_transpose` rule of a block-scaled
  spec: MX, or DeepSeek-V3 tiles (``deepseek_pow2`` with power-of-two
  scales); None otherwise."""
  if spec.granularity == "mx" and spec.scale_rule.startswith("mx_"):
    return spec.scale_rule
  if spec.granularity == "tile" and spec.scale_rule == "deepseek":
    return "deepseek_pow2" if spec.pow2 else "deepseek"
  return None


def operand_pair(t: jax.Array, last: Operand, first: Operand | None = None,
                 *, amax=None,
                 delayed: tuple[ScaleState, str, jax.Array] | None = None,
                 keys=(None, None), dtype=jnp.float32,
                 dequantized: tuple[bool, bool] = (False, False)):
  """The copies of ``t (..., C)`` for two GEMMs, ``(for last, for first)``:
  the `operand` ``last`` for the GEMM that contracts the last axis and
  ``first`` (default: ``last``'s copy, per tensor) for the one that
  contracts the rows, made in one pass where `pairable` says so.

  In one pass (`qlayers.cast_transpose`): per tensor, one cast writes the
  payload in both layouts (in one on Blackwell, both GEMMs reading it, the
  kernel computing the scale); row-wise, one kernel writes the copy scaled per
  row and the one scaled per column (transposed), after one that finds both
  amaxes; MXFP8 and UE8M0 tiles, one kernel writes both block layouts and
  their scales; MXFP4, both packed copies and scales;
  MXFP6, both copies with their FP6 values in E4M3 (`scaling.widened`; off
  NVIDIA GPUs `operand`'s copies widened, so the program's branches agree).
  The copy for ``first`` holds the transposed buffer seen as ``(M, C)`` (for
  MXFP4, the ``tn`` copy of ``t.T``), so the contraction-minor layout its
  GEMM takes is already there. The values are `operand`'s in either case;
  elsewhere the copies are `operand`'s own (``keys``: their
  stochastic-rounding keys). ``delayed``: ``(state, amax_compute_algo,
  running)`` of a delayed-scaling role whose `delayed_amax` is ``(amax,
  running)``; the per-tensor kernel then chooses that amax itself, from the
  state and ``t``'s amax, and writes the running amax, so ``amax`` and
  ``running`` are computed only where the kernel does not run; without a
  mesh it finds ``t``'s amax as it casts (`qlayers.cast_transpose`). The
  running amax is then returned third. ``dequantized``
  (for ``last``, for ``first``): that copy's GEMM only dequantizes it to
  BF16 (MX without MX tensor cores); an MXFP8/MXFP6 pair's copy then holds
  those values (`scaling.dequantized`), so no dequantize pass is left
  between the kernel and the GEMM.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from qlayers.dispatch import Operand
    >>> spec = qlayers.recipe("fp8_current").fprop.lhs
    >>> last, first = operand_pair(jnp.ones((2, 64, 64)), Operand(spec, 1))
    >>> last.payload.shape == first.payload.shape == (128, 64)
    True
  """
  if delayed is not None:
    state, algo, running = delayed
    if not (first is None and pairable(t, last) and not _square(last.spec)):
      # Only the per-tensor kernel takes the state and writes the running amax.
      return (*operand_pair(t, last, first, amax=amax, keys=keys, dtype=dtype,
                            dequantized=dequantized), running)
  if not pairable(t, last, first):
    q = operand(t, last, amax=amax, key=keys[0], dtype=dtype)
    return q, (q if first is None else
               operand(t, first, amax=amax, key=keys[1], dtype=dtype))
  spec = last.spec
  rows = (math.prod(t.shape[:-1]), t.shape[-1])
  if first is None and _square(spec):
    def xla_blocks(t):
      q = scaling.quantize(_rows(t), spec, 1)
      return q.payload, q.scale, q.payload.T

    def cuda_blocks(t):
      return cast_transpose.block_cast_transpose(_rows(t), spec.fmt,
                                                 pow2=spec.pow2)

    p, s, pt = lax.platform_dependent(t, cuda=cuda_blocks,
                                      default=xla_blocks)
    q = scaling.QTensor(p, s, spec.fmt.name, "block",
                        blocks.block_shape(rows, spec, last.axis),
                        last.axis, rows)
    return q, dataclasses.replace(q, payload=pt.T)
  if first is None:
    transpose = table.fp8_gemm_transposes(table.gpu_arch("cuda"))

    def xla(t):
      a = blocks.amax(t) if amax is None else jnp.asarray(amax, jnp.float32)
      mult, scale = scale_rules.unit_scales(a, spec)
      p = _rows(formats.cast(t.astype(jnp.float32) * mult, spec.fmt))
      return (p, p.T if transpose else None, scale,
              *(() if delayed is None else (running,)))

    def cuda(t):  # the amax's last step and the scale in the kernel
      if delayed is not None:
        # t's amax found by the kernel as it casts; under a mesh, where that
        # takes one more all-reduce per operand, `delayed_amax`'s reduction.
        bits = None if sharding.context_mesh() is None else jnp.max(
            blocks.magnitude_bits(t))
        return cast_transpose.cast_transpose(
            _rows(t), spec.fmt, amax=bits,
            delayed=_kernel_state(state, algo), margin=spec.margin,
            pow2=spec.pow2, transpose=transpose)
      return cast_transpose.cast_transpose(_rows(t), spec.fmt, amax=amax,
                                           margin=spec.margin, pow2=spec.pow2,
                                           transpose=transpose)

    p, pt, scale, *new_running = lax.platform_dependent(t, cuda=cuda,
                                                        default=xla)
    q = scaling.QTensor(p, scale, spec.fmt.name, "tensor", None, last.axis,
                        rows)
    second = q if pt is None else dataclasses.replace(q, payload=pt.T)
    return (q, second, *new_running)

  if spec.scale_rule == "nvfp4":
    return _nvfp4_pair(t, last, first, keys)
  if spec.fmt.bits == 4:
    return _fp4_pair(t, last, first, keys)
  dequantized = tuple(bool(d) and spec.granularity == "mx"
                      for d in dequantized)
  if spec.fmt.packed:
    return _fp6_pair(t, last, first, dequantized)

  def xla_copies(t):
    a, b = (scaling.quantize(_rows(t), spec, axis) for axis in (1, 0))
    a, b = (scaling.dequantized(q) if d else q
            for q, d in zip((a, b), dequantized))
    return a.payload, a.scale, b.payload.T, b.scale.T

  def cuda_copies(t):
    if spec.granularity == "row":
      return cast_transpose.row_cast_transpose(
          _rows(t), spec.fmt, margin=spec.margin, pow2=spec.pow2)
    return cast_transpose.mx_cast_transpose(
        _rows(t), spec.fmt, _block_rule(spec), block_size=spec.block_size,
        dequantized=dequantized)

  p, s, pt, st = lax.platform_dependent(t, cuda=cuda_copies,
                                        default=xla_copies)

  def copy(payload, scale, axis):
    return scaling.QTensor(payload, scale, spec.fmt.name, spec.granularity,
                           blocks.block_shape(rows, spec, axis), axis, rows,
                           dequantized=dequantized[1 - axis])
  return copy(p, s, 1), copy(pt.T, st.T, 0)


def _kernel_state(state: ScaleState, algo: str):
  """A delayed role's ``(history, running)`` as `cast_transpose` takes them:
  the history itself for the ``max`` algorithm at a power-of-two length,
  otherwise its `scaling.history_amax` as one element."""
  history = state.amax_history
  n = history.shape[-1]
  if algo != "max" or n & (n - 1):
    history = scaling.history_amax(history, algo)[None]
  return history, state.amax


def _packed_pair(t, last: Operand, first: Operand, keys, kernel,
                 finish=(None, None)):
  """`operand_pair`'s FP4/FP6 copies (MXFP4, NVFP4, MXFP6): ``last`` along
  axis 1 and ``first``, the ``tn`` copy of ``t.T``, each of its Hadamard
  transform if its operand says so and rounded stochastically with its key
  if the spec says so (derived from the data where None, as `operand`
  derives it). On NVIDIA GPUs ``kernel(rows, keys)`` makes both
  (`_fp4_pair`, `_nvfp4_pair`, `_fp6_pair`); elsewhere they are `operand`'s,
  with its values, each as its ``finish`` returns it (where not None:
  `scaling.widened` or `scaling.dequantized`, as the kernel writes it)."""
  rows = _rows(t)
  keys = (tuple(_data_key(rows) if k is None else k for k in keys)
          if last.spec.stochastic else ())

  def xla(t, *keys):
    copies = (operand(t, op, key=k)
              for op, k in zip((last, first), keys or (None, None)))
    return tuple(q if f is None else f(q) for q, f in zip(copies, finish))

  return lax.platform_dependent(rows, *keys, default=xla,
                                cuda=lambda t, *keys: kernel(t, keys))


def _tn_copies(spec, rows, p, s, pt, st, levels=((None,) * 2,) * 2,
               dequantized=(False, False)):
  """The two `QTensor` of a `_packed_pair`'s payloads ``p``, ``pt`` (of
  ``t.T``) and scales ``s``, ``st``; ``levels``: NVFP4's ``(block_scale,
  tensor_scale)`` of each; ``dequantized``: of each (`scaling.dequantized`
  payloads)."""
  m, c = rows.shape
  return tuple(
      scaling.QTensor(payload, scale, spec.fmt.name, spec.granularity,
                      blocks.block_shape(shape, spec, 1), 1, shape,
                      transposed, *level, dequantized=d)
      for payload, scale, shape, transposed, level, d in
      ((p, s, (m, c), False, levels[0], dequantized[0]),
       (pt, st, (c, m), True, levels[1], dequantized[1])))


def _fp4_pair(t, last: Operand, first: Operand, keys):
  """`_packed_pair` of MXFP4 by `qlayers.cast_transpose.fp4_cast_transpose`
  (the transforms in the kernel)."""
  spec = last.spec

  def kernel(rows, keys):
    return _tn_copies(spec, rows, *cast_transpose.fp4_cast_transpose(
        rows, spec.scale_rule, keys=keys or None,
        hadamard=(last.hadamard, first.hadamard)))
  return _packed_pair(t, last, first, keys, kernel)


def _fp6_pair(t, last: Operand, first: Operand, dequantized):
  """`_packed_pair` of MXFP6 by `qlayers.cast_transpose.mx_cast_transpose`,
  whose copies' FP6 values are E4M3 payloads (`scaling.widened`): cuDNN's
  MXFP8 GEMM takes them as they are, where packed codes would cost it a
  widening pass per operand. ``dequantized`` (per copy): its BF16 values
  instead (`scaling.dequantized`)."""
  spec = last.spec

  def kernel(rows, keys):
    del keys  # round to nearest (`pairable`)
    return _tn_copies(spec, rows, *cast_transpose.mx_cast_transpose(
        rows, spec.fmt, spec.scale_rule, dequantized=dequantized),
                      dequantized=dequantized)
  return _packed_pair(t, last, first, (None, None), kernel, tuple(
      scaling.dequantized if d else scaling.widened for d in dequantized))


def _nvfp4_pair(t, last: Operand, first: Operand, keys):
  """`_packed_pair` of NVFP4 by `qlayers.cast_transpose.nvfp4_cast_transpose`:
  1 x 16 tiles (``first`` of the 16-point transform along the rows if
  ``first.hadamard``), or 16 x 16 blocks for both (``block`` granularity,
  the weights). The two tensor amaxes come first: of ``t`` and of its
  transform from one read (`qlayers.cast_transpose.nvfp4_amaxes`), or
  without the transform XLA's reduction of ``t``."""
  spec = last.spec
  square = spec.granularity == "block"

  def kernel(rows, keys):
    if first.hadamard:
      amax, amax_t = cast_transpose.nvfp4_amaxes(rows)
    else:
      amax = amax_t = blocks.amax(rows)
    p, e4m3, pt, e4m3_t = cast_transpose.nvfp4_cast_transpose(
        rows, amax, None if square else amax_t, square=square,
        hadamard=bool(first.hadamard), keys=keys or None)
    # `scaling.quantize`'s stored scale: the E4M3 block scale times S_dec.
    s_dec, s_dec_t = (scale_rules.rdivide_rn(
        1.0, scale_rules.nvfp4_encode_scale(a)) for a in (amax, amax_t))
    return _tn_copies(
        spec, rows, p, e4m3.astype(jnp.float32) * s_dec,
        pt, e4m3_t.astype(jnp.float32) * s_dec_t,
        levels=((e4m3, s_dec), (e4m3_t, s_dec_t)))
  return _packed_pair(t, last, first, keys, kernel)


def _gathered(t, op: Operand, axes, **kw):
  """`operand` of the whole of ``t``, a shard along dim 0 over ``axes``."""
  def whole(t):
    return lax.all_gather(t, axes, axis=0, tiled=True)
  if op.spec is None:
    return whole(t.astype(kw["dtype"]))
  if not (op.spec.stochastic or (op.hadamard and op.axis == 0)):
    q = partition.gather(operand(t, op, **kw), axes)
    if q is not None:
      return q
  return operand(whole(t), op, **kw)


def _qdq(t, spec, axis: int, amax=None):
  """Quantize-dequantize ``t`` (2-D) along ``axis``, in ``t``'s layout."""
  if spec is None:
    return t
  tn = axis != 1 and spec.fmt.packed
  d = operand(t, Operand(spec, axis, tn), amax=amax).dequantize(t.dtype)
  return d.T if tn else d


def fake_quant_matmul(x, w, recipe: Recipe | str, state=None):
  """Reference Fprop: quantize-dequantize both operands, then an FP32 dot.

  The casts are straight-through (identity gradient), so `jax.grad` of this
  function is the unquantized backward of the fake-quantized forward: the
  oracle the tests compare `quantized_matmul` against.
  """
  recipe = load_recipe(recipe)
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  w = w.astype(jnp.float32)
  fx, fw = recipe.fprop.lhs, recipe.fprop.rhs
  ax = aw = None
  if recipe.delayed:
    ax, _ = delayed_amax(x2, state["x"], recipe)
    aw, _ = delayed_amax(w, state["w"], recipe)

  def ste(t, spec, axis, amax):
    return t + lax.stop_gradient(_qdq(t, spec, axis, amax) - t)

  y = jnp.dot(ste(x2, fx, 1, ax), ste(w, fw, 0, aw),
              precision=lax.Precision.HIGHEST)
  return y.reshape(*x.shape[:-1], w.shape[1])
