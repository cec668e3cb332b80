"""FP8 copies of ``t (R, C)`` scaled per tensor or per row, in 64 x 64 tiles.

A per-tensor FP8 copy feeds two GEMMs that contract different axes.
cuBLASLt's FP8 GEMM takes only operands whose contraction axis is the minor
one, so XLA, given one payload, writes it in one layout and transposes it
for the other GEMM: a second kernel that reads the payload again. XLA does
not fuse that transpose into the cast: the GEMMs' optimization barriers
(`qlayers.forms`) sit between them, and layout assignment places the copy
after the barrier.

`cast_transpose` reads each tile of ``t`` once and writes the saturated,
round-to-nearest-even cast of ``t * s`` both as ``(R, C)`` and as ``(C,
R)``, each row-major; it computes the multiplier ``s`` from the tensor's
amax itself (and writes ``1 / s``), so no kernel of its own sits between
the amax and the cast; for a delayed scale it also reduces the role's amax
history and picks the amax to scale by, so XLA keeps no per-operand kernel
for either, and on one device it finds the tensor's amax as it casts (the
running amax's), so no reduction of the tensor runs before it after the
first step. The transposed copy is handed to its GEMM as ``copy.T``, a
view XLA lays out over the kernel's buffer, so no transpose pass is left.
Blackwell's FP8 GEMM reads either layout of one copy; there
``transpose=False`` writes that copy alone, the scale (and a delayed
role's amax) still computed in the kernel rather than in XLA kernels of
their own.

`row_cast_transpose` does it for row-wise FP8, whose copies are scaled per
row and per column: one kernel finds both amaxes of each tile, XLA turns
them into each row's and column's multiplier, a second kernel writes the
two copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import blocks
from qlayers import formats
from qlayers import partition
from qlayers import scale_rules
from qlayers.cast_transpose import _base
from qlayers.formats import Format

__all__ = ["TILE", "supported", "cast_transpose", "row_cast_transpose"]


# Rows and columns of one tile; both dims of ``t`` must be multiples of it.
TILE = 64


def supported(shape: tuple[int, ...], fmt: Format) -> bool:
  """Whether `cast_transpose` takes a 2-D ``shape`` tensor cast to ``fmt``:
  whole tiles, an unpacked FP8 format."""
  return _base.is_fp8(fmt) and _base.whole_tiles(shape, TILE)


def _fp8_tiles(name: str, t: jax.Array, fmt: Format | str) -> Format:
  """``fmt`` as a `Format`, once `supported` says ``t`` and it are whole
  tiles of an FP8 format; else a ValueError naming kernel ``name``."""
  fmt = formats.get_format(fmt)
  if not supported(t.shape, fmt):
    raise ValueError(f"{name} takes a 2-D tensor whose dims are multiples "
                     f"of {TILE} and an FP8 format; got {t.shape} and "
                     f"{fmt.name}.")
  return fmt


def _kernel(*refs, fmt: Format, margin: int, pow2: bool, delayed: bool,
            found: bool, transpose: bool, interpret: bool):
  if found:  # t's amax found here, into the word of the first step's
    *refs, cur_ref = refs
  elif delayed:
    *refs, run_ref = refs
  *refs, s_ref = refs
  qt_ref = refs.pop() if transpose else None
  if delayed:
    amax_ref, history_ref, running_ref, t_ref, q_ref = refs
  else:
    amax_ref, t_ref, q_ref = refs
  a = amax_ref[...]
  if not jnp.issubdtype(a.dtype, jnp.floating):
    # The max of magnitude bits (see `cast_transpose`): as blocks.amax.
    a = blocks.amax_from_bits(
        a, jnp.float32 if found else t_ref.dtype).astype(jnp.float32)
  if found:  # `delayed_amax`'s selects; ``a`` t's amax on the first step
    stored = jnp.max(history_ref[...], keepdims=True)
    running = running_ref[...]
    first = jnp.where(jnp.isfinite(a), jnp.maximum(running, a), a)
    a = jnp.where(stored > 0, stored, first)
  elif delayed:  # `qlayers.delayed.delayed_amax`'s selects, t's amax current
    finite = jnp.isfinite(a)
    running = running_ref[...]
    running = jnp.where(finite, jnp.maximum(running, a), running)
    run_ref[...] = running  # the same in every program
    stored = jnp.max(history_ref[...], keepdims=True)
    a = jnp.where(finite, jnp.where(stored > 0, stored, running), a)
  v = t_ref[...].astype(jnp.float32)
  q, scale = _te_copy(v, jnp.reshape(a, (1, 1)), fmt, margin, pow2, interpret)
  q_ref[...] = q
  if transpose:
    qt_ref[...] = q.T
  s_ref[...] = jnp.reshape(scale, (1,))  # the same in every program
  if found:  # this tile's share of t's amax (`_found_amax`)
    _, plt = _base.pallas()
    plt.atomic_max(cur_ref, (jnp.int32(0),), jnp.max(_base.fp32_bits(v)))


def _te_copy(v, a, fmt: Format, margin: int, pow2: bool, interpret: bool):
  """(payload, stored scale ``1 / s``) of FP32 ``v`` scaled by TE's
  multiplier ``s`` of amax ``a`` (`scale_rules.unit_scales`, its divisions
  the kernel's), ``a`` broadcasting against ``v``."""
  mult = scale_rules.te_multiplier(
      a, fmt, margin=margin, pow2=pow2,
      divide=functools.partial(_base.divide, interpret=interpret))
  # NaN for a non-finite amax, said explicitly: the kernel's min need not
  # propagate it.
  mult = jnp.where(jnp.isfinite(a), mult, jnp.nan)
  return (_base.saturating_cast(v * mult, fmt, interpret),
          _base.divide(1.0, mult, interpret))


def _cast_call(shape: tuple[int, int], fmt: Format, margin: int, pow2: bool,
               history: int, found: bool, transpose: bool, interpret: bool):
  """`cast_transpose`'s kernel for a ``shape`` tensor (``history``: the
  delayed role's history length, 0 without one): a function of the amax
  ``(1,)``, the history and running amax if delayed, and the tensor. With
  ``found`` the amax is the first step's (`_first_amax_kernel`'s word),
  and each program writes its tile's amax into that word by an atomic max
  (`_found_amax`): it holds the whole tensor's on the first step already,
  and is read only then."""
  pl, plt = _base.pallas()
  one = pl.BlockSpec((1,), lambda i, j: (0,))
  in_specs = [one]
  if history:
    in_specs += [pl.BlockSpec((history,), lambda i, j: (0,)), one]
  rows, cols = shape
  tile = (TILE, TILE)
  copies = [((rows, cols), lambda i, j: (i, j))]
  if transpose:
    copies.append(((cols, rows), lambda i, j: (j, i)))
  # The scale; the running amax, or t's amax's bits
  scalars = [jnp.float32] + [jnp.uint32 if found else jnp.float32] * bool(
      history)
  return pl.pallas_call(
      functools.partial(_kernel, fmt=fmt, margin=margin, pow2=pow2,
                        delayed=bool(history), found=found,
                        transpose=transpose, interpret=interpret),
      grid=(rows // TILE, cols // TILE),
      in_specs=in_specs + [pl.BlockSpec(tile, lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec(tile, index) for _, index in copies]
      + [one] * len(scalars),
      out_shape=[jax.ShapeDtypeStruct(shape, fmt.dtype)
                 for shape, _ in copies]
      + [jax.ShapeDtypeStruct((1,), d) for d in scalars],
      input_output_aliases={0: len(copies) + 1} if found else {},
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret,
      name="qlayers_cast_transpose" if transpose else "qlayers_cast")


def _first_amax_kernel(history_ref, zero_ref, t_ref, out_ref):
  """While the history is empty (the first step), this block's share of
  t's amax, its magnitude bits as FP32 (an atomic max into the zeroed
  word); otherwise nothing, and ``t`` is not read."""
  del zero_ref
  pl, plt = _base.pallas()

  @pl.when(jnp.max(history_ref[...]) == 0)
  def _():
    def tile_max(k, m):
      v = t_ref[:, pl.ds(k * TILE, TILE)].astype(jnp.float32)
      return jnp.maximum(m, jnp.max(_base.fp32_bits(v)))
    m = jax.lax.fori_loop(0, t_ref.shape[1] // TILE, tile_max, jnp.uint32(0))
    plt.atomic_max(out_ref, (jnp.int32(0),), m)


def _first_block(cols: int) -> int:
  """Columns of one `_first_amax_kernel` block: four tiles where they
  divide ``cols``, so that a step with a history reads it in few programs,
  else one. The kernel's code still depends on ``cols`` (its row stride),
  so XLA compiles it once per tensor width and dtype."""
  return 4 * TILE if cols % (4 * TILE) == 0 else TILE


def _first_amax_call(shape: tuple[int, int], history: int, interpret: bool):
  """`_found_amax`'s first-step kernel for a ``shape`` tensor."""
  pl, plt = _base.pallas()
  rows, cols = shape
  width = _first_block(cols)
  one = pl.BlockSpec((1,), lambda i, j: (0,))
  return pl.pallas_call(
      _first_amax_kernel,
      grid=(rows // TILE, cols // width),
      in_specs=[pl.BlockSpec((history,), lambda i, j: (0,)), one,
                pl.BlockSpec((TILE, width), lambda i, j: (i, j))],
      out_specs=[one],
      out_shape=[jax.ShapeDtypeStruct((1,), jnp.uint32)],
      input_output_aliases={1: 0},
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_first_amax")


# Jitted with its settings static, as every entry point of the package
# (`qlayers.cast_transpose`).
@functools.partial(jax.jit, static_argnames=("fmt", "margin", "pow2",
                                             "transpose", "interpret"))
def cast_transpose(t: jax.Array, fmt: Format | str, *,
                   amax: jax.Array | None = None,
                   delayed: tuple[jax.Array, jax.Array] | None = None,
                   margin: int = 0, pow2: bool = False,
                   transpose: bool = True, interpret: bool = False
                   ) -> tuple[jax.Array, ...]:
  """Per-tensor FP8 ``(q, q.T, scale)`` of ``t (R, C)``, in one pass.

  ``q`` is the saturating cast of ``t * s``, ``s`` Transformer Engine's
  multiplier `qlayers.scale_rules.te_multiplier` of the amax, and ``scale``
  its stored ``1 / s``: `qlayers.scale_rules.unit_scales` for a ``te`` spec.
  The kernel computes ``s`` (an IEEE division, PTX ``div.rn.f32``) and, for
  ``t``'s own amax, the amax from the max of ``t``'s magnitude bits, so only
  that one reduction runs before it; none for a delayed role's (`_found_amax`:
  the kernel finds it as it casts).

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of `TILE`.
    fmt: an FP8 format (``"e4m3"``, ``"e5m2"``).
    amax: the amax to scale by (with ``delayed``: ``t``'s own, the
      current one), an FP32 scalar or the max of ``t``'s magnitude bits as
      `qlayers.blocks` reduces them (the caller's reduction, shared with
      its own amax); None: ``t``'s own, reduced here, or with ``delayed``
      found by the kernel as it casts (`_found_amax`).
    delayed: ``(history, running)`` of a delayed-scaling role: its amax
      history ``(H,)`` (H a power of two; or the history's amax as one
      element) and the running amax ``()`` before this use. The amax to
      scale by is then `qlayers.delayed.delayed_amax`'s, chosen in the
      kernel, so no XLA kernel reduces the history or picks between it and
      the running amax; the kernel also writes `delayed_amax`'s new
      running amax, returned fourth, so no XLA kernel computes that either.
    margin, pow2: the spec's (`te_multiplier`).
    transpose: False: ``q.T`` is not written (None in its place), for GPUs
      whose FP8 GEMM reads either layout of one copy (Blackwell): the
      kernel then only spares XLA's scale and history kernels.
    interpret: run in Pallas' interpreter (any platform; for tests).
      Otherwise the kernel is lowered for NVIDIA GPUs only.

  Example:
    >>> import jax.numpy as jnp
    >>> q, qt, scale = cast_transpose(jnp.full((64, 128), 224.0), "e4m3",
    ...                               interpret=True)
    >>> q.shape, qt.shape, float(qt[0, 0]), float(scale)
    ((64, 128), (128, 64), 448.0, 0.5)
    >>> history = jnp.zeros(4).at[2].set(896.0)  # a delayed role's
    >>> _, _, scale, running = cast_transpose(jnp.ones((64, 64)), "e4m3",
    ...     delayed=(history, jnp.float32(0)), interpret=True)
    >>> float(scale), float(running)
    (2.0, 1.0)
  """
  fmt = _fp8_tiles("cast_transpose", t, fmt)
  inputs = []
  if delayed is not None:
    history, running = (jnp.asarray(v, jnp.float32) for v in delayed)
    n = history.shape[-1] if history.ndim == 1 else 0
    if running.shape != () or n & (n - 1) or not n:
      raise ValueError(
          "cast_transpose's delayed takes a 1-D history whose length is a "
          "power of two and a scalar running amax; got history "
          f"{history.shape}, running {running.shape}.")
    inputs = [history, jnp.reshape(running, (1,))]
  if delayed is not None and amax is None:
    return _found_amax(t, fmt, *inputs, margin=margin, pow2=pow2,
                       transpose=transpose, interpret=interpret)
  if amax is None:
    a = jnp.max(blocks.magnitude_bits(t))
  elif jnp.issubdtype(jnp.asarray(amax).dtype, jnp.unsignedinteger):
    a = jnp.asarray(amax)
  else:
    a = jnp.asarray(amax, jnp.float32)
  n = inputs[0].shape[0] if inputs else 0
  outs = partition.cast(_cast_call, (fmt, margin, pow2, n, False, transpose,
                                     interpret),
                        jnp.reshape(a, (1,)), *inputs, t,
                        layouts=(partition.LIKE_T,)
                        + (partition.LIKE_T_T,) * transpose
                        + ((),) * (1 + bool(n)), tile=TILE)
  q, qt = outs[0], outs[1] if transpose else None
  if delayed is None:
    return q, qt, outs[-1][0]
  return q, qt, outs[-2][0], outs[-1][0]


def _found_amax(t, fmt: Format, history, running, *, margin: int,
                pow2: bool, transpose: bool, interpret: bool):
  """`cast_transpose` of a delayed role without its amax given: no
  reduction of ``t`` before the cast. Each program of the cast finds its
  tile's amax and writes it into one word by an atomic max, from which
  the running amax and the NaN scale of a non-finite ``t`` are set after
  it (`qlayers.delayed.delayed_amax`'s). Only the first step, whose empty
  history scales by ``t``'s own amax (with the running one), needs that
  amax before the cast: `_first_amax_kernel` reads ``t`` for it then, and
  on every later step reads the history alone.

  The values are `delayed_amax`'s but for one case: with a stored history
  and a non-finite ``t``, the payload is ``t`` cast by the stored amax
  (XLA's is all NaN) under the same NaN scale, so it dequantizes, and its
  GEMMs compute, to NaN alike.

  Under a partitioning rule each device's atomic maximum is its shard's,
  combined over the devices (`qlayers.partition.cast`'s ``reduced``)."""
  n = history.shape[0]
  zero = jnp.zeros((1,), jnp.uint32)
  first, = partition.cast(_first_amax_call, (n, interpret), history, zero,
                          t, layouts=((),), tile=TILE, reduced=(0,))
  outs = partition.cast(_cast_call, (fmt, margin, pow2, n, True, transpose,
                                     interpret),
                        first, history, running, t,
                        layouts=(partition.LIKE_T,)
                        + (partition.LIKE_T_T,) * transpose + ((),) * 2,
                        tile=TILE, reduced=(2 + transpose,))
  q, qt = outs[0], outs[1] if transpose else None
  cur = blocks.amax_from_bits(outs[-1][0], jnp.float32)
  finite = jnp.isfinite(cur)
  running = running[0]
  return (q, qt, jnp.where(finite, outs[-2][0], jnp.nan),
          jnp.where(finite, jnp.maximum(running, cur), running))


def _row_amax_kernel(t_ref, r_ref, c_ref):
  mag = _base.fp32_bits(t_ref[...].astype(jnp.float32))
  r_ref[...] = jnp.max(mag, axis=1, keepdims=True)
  c_ref[...] = jnp.max(mag, axis=0, keepdims=True)


def _row_kernel(mr_ref, mc_ref, t_ref, q_ref, qt_ref, *, fmt: Format,
                interpret: bool):
  v = t_ref[...].astype(jnp.float32)
  q_ref[...] = _base.saturating_cast(v * mr_ref[...], fmt, interpret)
  qt_ref[...] = _base.saturating_cast(v * mc_ref[...], fmt, interpret).T


@functools.partial(jax.jit, static_argnames=("fmt", "margin", "pow2",
                                             "interpret"))
def row_cast_transpose(t: jax.Array, fmt: Format | str, *, margin: int = 0,
                       pow2: bool = False, interpret: bool = False):
  """Both row-wise copies of ``t (R, C)``: ``(q, s, qt, st)``, in two reads
  of ``t`` (one for the row and column amaxes, one for the copies). The
  multipliers and scales of the rows and columns are computed between the
  two, by XLA (`qlayers.scale_rules.unit_scales`' divisions, one per row
  and column): in the cast kernel, where each thread holds parts of many
  rows and columns, they were most of its instructions.

  ``q (R, C)`` with FP32 scales ``s (R, 1)`` is ``t`` scaled per row (TE's
  rule, `qlayers.scaling.quantize` along axis 1); ``qt (C, R)`` with ``st
  (C, 1)`` is ``t`` scaled per column (along axis 0), transposed: the
  contraction-minor copy of the Wgrad (x, g) or Dgrad (w) GEMM.

  Example:
    >>> import jax.numpy as jnp
    >>> t = jnp.ones((64, 128)).at[0, 5].set(4.0)
    >>> q, s, qt, st = row_cast_transpose(t, "e4m3", pow2=True,
    ...                                   interpret=True)
    >>> float(s[0, 0]), float(s[1, 0]), float(st[5, 0]), qt.shape
    (0.015625, 0.00390625, 0.015625, (128, 64))
  """
  fmt = _fp8_tiles("row_cast_transpose", t, fmt)
  rows, cols = t.shape
  # Each device's shard of whole tiles: its partial maxima, reduced by XLA
  # (across devices too), then its copies with the whole rows' and columns'
  # scales (`qlayers.partition.cast`).
  r, c = partition.cast(_row_amax_call, (interpret,), t,
                        layouts=((("r", 1), ("c", TILE)),
                                 (("r", TILE), ("c", 1))),
                        block=(TILE, TILE))
  mults, scales = [], []
  for bits, axis in ((r, 1), (c, 0)):
    a = blocks.amax_from_bits(jnp.max(bits, axis=axis, keepdims=True),
                              jnp.float32)
    mults.append(scale_rules.te_multiplier(a, fmt, margin=margin, pow2=pow2))
    scales.append(scale_rules.rdivide_rn(1.0, mults[-1]))
  q, qt = partition.cast(
      _row_cast_call, (fmt, interpret), *mults, t,
      layouts=(partition.LIKE_T, partition.LIKE_T_T),
      in_layouts=((("r", 1), ("c", cols)), (("r", rows), ("c", 1))),
      block=(TILE, TILE))
  return q, scales[0], qt, scales[1].T


def _row_amax_call(shape: tuple[int, int], interpret: bool):
  """`row_cast_transpose`'s first kernel for a ``shape`` tensor: the
  magnitude-bit maxima of each tile's rows and columns."""
  pl, plt = _base.pallas()
  rows, cols = shape
  grid, tile = (rows // TILE, cols // TILE), (TILE, TILE)
  return pl.pallas_call(
      _row_amax_kernel, grid=grid,
      in_specs=[pl.BlockSpec(tile, lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((TILE, 1), lambda i, j: (i, j)),
                 pl.BlockSpec((1, TILE), lambda i, j: (i, j))],
      out_shape=[jax.ShapeDtypeStruct((rows, grid[1]), jnp.uint32),
                 jax.ShapeDtypeStruct((grid[0], cols), jnp.uint32)],
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_row_amaxes")


def _row_cast_call(shape: tuple[int, int], fmt: Format, interpret: bool):
  """`row_cast_transpose`'s second kernel for a ``shape`` tensor: both
  copies, given the rows' multipliers ``(R, 1)`` and the columns' ``(1,
  C)``."""
  pl, plt = _base.pallas()
  rows, cols = shape
  grid, tile = (rows // TILE, cols // TILE), (TILE, TILE)
  return pl.pallas_call(
      functools.partial(_row_kernel, fmt=fmt, interpret=interpret),
      grid=grid,
      in_specs=[pl.BlockSpec((TILE, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((1, TILE), lambda i, j: (0, j)),
                pl.BlockSpec(tile, lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec(tile, lambda i, j: (i, j)),
                 pl.BlockSpec(tile, lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
                 jax.ShapeDtypeStruct((cols, rows), fmt.dtype)],
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_row_cast_transpose")
