"""One pass per operand on NVIDIA GPUs: FP8 casts that write an operand's
two quantized copies at once (Transformer Engine's cast-transpose).

A per-tensor FP8 copy of ``t (R, C)`` feeds two GEMMs that contract
different axes: x is contracted over K in Fprop and over M in Wgrad, w over
K and N, g over N and M. cuBLASLt's FP8 GEMM takes only operands whose
contraction axis is the minor one, so XLA, given one payload, writes it in
one layout and transposes it for the other GEMM: a second kernel that reads
the payload again (``benchmarks/RESULTS.md``, "One pass per operand").
XLA does not fuse that transpose into the cast: the GEMMs' optimization
barriers (`qlayers.forms`) sit between them, and layout assignment places
the copy after the barrier.

`cast_transpose` is a Pallas (Triton) kernel that reads each tile of ``t``
once and writes the saturated, round-to-nearest-even cast of ``t * s``
both as ``(R, C)`` and as ``(C, R)``, each row-major; it computes the
multiplier ``s`` from the tensor's amax itself (and writes ``1 / s``), so
no kernel of its own sits between the amax and the cast; for a delayed
scale it also reduces the role's amax history and picks the amax to scale
by, so XLA keeps no per-operand kernel for either, and on one device it
finds the tensor's amax as it casts (the running amax's), so no reduction
of the tensor runs before it after the first step. Its values are those of
`qlayers.formats.cast` (the CPU tests run it in Pallas' interpreter and
compare bits); the transposed copy is handed to its GEMM as ``copy.T``, a
view XLA lays out over the kernel's buffer, so no transpose pass is left.
Blackwell's FP8 GEMM reads either layout of one copy; there
``transpose=False`` writes that copy alone, the scale (and a delayed
role's amax) still computed in the kernel rather than in XLA kernels of
their own.

`row_cast_transpose` does it for row-wise FP8, whose copies are scaled per
row and per column: one kernel finds both amaxes of each tile, XLA turns
them into each row's and column's multiplier, a second kernel writes the
two copies.

`mx_cast_transpose` does the same for MXFP8, whose two copies differ in
more than layout: one has a scale per 32 elements of a row, the other per
32 of a column. Each is otherwise a second pass over the wide tensor; the
kernel reads a 32 x 32 tile once and writes both copies (the column-blocked
one transposed, contraction-last as cuDNN's block-scaled GEMM takes it) and
their E8M0 scales, with `qlayers.scaling.quantize`'s values; for MXFP6
it writes each FP6 value as the E4M3 value it is, the payload cuDNN's
block-scaled GEMM takes (`qlayers.scaling.widened`). With 128 x 128
tiles it makes DeepSeek-V3's 1 x 128 tile copies, with power-of-two scales
(`deepseek_v3_ue8m0`, which Blackwell runs as MXFP8) or with DeepSeek-V3's
own (`deepseek_v3` on Hopper's blockwise GEMM: the scale's division by the
format's max in integer steps, its reciprocal by PTX ``rcp.rn.f32``), and
`block_cast_transpose` the 128 x 128 weight blocks in both layouts.

`fp4_cast_transpose` makes MXFP4's two copies, each packed two E2M1 codes
per byte along its own contraction axis, where XLA makes each in four
passes (block amax, scale, unpacked codes, packing). With stochastic
rounding each copy draws, in the kernel, the random bytes `qlayers.formats`
draws from its key (`qlayers.threefry`), so no random-bits array is
written or read.

`nvfp4_cast_transpose` makes NVFP4's two copies (E2M1 with E4M3 scales per
16 under a per-tensor FP32 scale): 1 x 16 tiles along each axis, the one
along the rows (Wgrad's) of the 16-point Hadamard transform if asked, or
16 x 16 blocks in both layouts (the weights). The per-tensor scales need
the whole tensor's amax first: `nvfp4_amaxes` finds those of the tensor and
of its transform in one read. `transform` is the Hadamard transform alone
in one pass, for the recipes whose transformed operands XLA quantizes.

The block-scaled kernels write their payloads as uint32 words (four FP8
bytes, eight E2M1 codes), which XLA views as the bytes: Triton widens each
byte it stores to 16 and 32 bits first. Compiled for a GPU that has them
(`qlayers.table.gpu_arch`: sm_89 for FP8, sm_100 for FP6 and FP4) they
round to nearest with PTX's conversions, ``cvt.rn.satfinite`` to two
E4M3/E5M2/E2M3/E3M2/E2M1 values at once, as inline assembly; elsewhere
(Pallas' interpreter, the CPU tests) with Triton's casts and
`qlayers.formats`' FP32 steps, which round and saturate alike. The one
difference, NaN (the conversions give FP4 and FP6 their largest code),
never reaches a payload: a block holding Inf or NaN has a NaN scale, and
its FP4/FP6 codes are written as zeros, in XLA's path too
(`qlayers.scaling.quantize`). The FP6 and 4-bit kernels hold each block's
elements in one thread as arrays of their own (`_split_last`), so its
amax, its Hadamard transform (`qlayers.hadamard.butterfly`'s stages on the
list) and its words need no exchanges across lanes.

The cast kernels run under a partitioning rule (`qlayers.partition.cast`):
in a sharded program each device casts its shard, the 4-bit ones drawing
each element's stochastic-rounding bits at its place in the whole tensor.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qlayers import blocks
from qlayers import formats
from qlayers import hadamard as hadamard_lib
from qlayers import partition
from qlayers import scale_rules
from qlayers import table
from qlayers import threefry
from qlayers.formats import Format

__all__ = ["TILE", "supported", "cast_transpose", "row_cast_transpose",
           "mx_supported",
           "mx_cast_transpose", "block_cast_transpose", "fp4_supported",
           "fp4_cast_transpose", "nvfp4_supported", "nvfp4_cast_transpose",
           "nvfp4_amaxes", "nvfp4_tile_rows", "transform_supported",
           "transform"]

# Rows and columns of one tile; both dims of ``t`` must be multiples of it.
TILE = 64


def _pallas():
  """Pallas and its Triton parameters, imported when a kernel is built (they
  load Mosaic and Triton bindings that a CPU-only user never needs)."""
  from jax.experimental import pallas
  from jax.experimental.pallas import triton
  return pallas, triton


def _whole_tiles(shape: tuple[int, ...], tile: int) -> bool:
  """A 2-D ``shape`` of whole ``tile`` x ``tile`` tiles."""
  return len(shape) == 2 and all(d >= tile and d % tile == 0 for d in shape)


def _fp8(fmt: Format) -> bool:
  """An unpacked signed 8-bit format (FP8)."""
  return (fmt.signed and not fmt.packed and fmt.dtype is not None
          and jnp.dtype(fmt.dtype).itemsize == 1)


def supported(shape: tuple[int, ...], fmt: Format) -> bool:
  """Whether `cast_transpose` takes a 2-D ``shape`` tensor cast to ``fmt``:
  whole tiles, an unpacked FP8 format."""
  return _fp8(fmt) and _whole_tiles(shape, TILE)


def _fp8_tiles(name: str, t: jax.Array, fmt: Format | str) -> Format:
  """``fmt`` as a `Format`, once `supported` says ``t`` and it are whole
  tiles of an FP8 format; else a ValueError naming kernel ``name``."""
  fmt = formats.get_format(fmt)
  if not supported(t.shape, fmt):
    raise ValueError(f"{name} takes a 2-D tensor whose dims are multiples "
                     f"of {TILE} and an FP8 format; got {t.shape} and "
                     f"{fmt.name}.")
  return fmt


def _payload_dtype(fmt: Format):
  """The dtype a kernel writes ``fmt``'s values in: its own (FP8), or E4M3
  for FP6, which holds every E2M3 and E3M2 value (the widened payload of
  `qlayers.scaling.widened`)."""
  return jnp.float8_e4m3fn if fmt.bits == 6 else fmt.dtype


# The FP8 formats whose conversion from FP32 Triton compiles to PTX
# ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (sm_89 on): round to nearest even,
# +-Inf and overflow to +-max, NaN to NaN; `formats.cast`'s values.
_SATFINITE = (formats.E4M3, formats.E5M2)


def _saturating_cast(v, fmt: Format, interpret: bool):
  """`formats.cast` of FP32 ``v`` in a kernel: clip to [-max, max] (NaN
  stays NaN, said explicitly: the kernel's min/max need not propagate it),
  then round to nearest even. On the GPU, E4M3 and E5M2 leave the clipping
  to the conversion instruction, which saturates (`_SATFINITE`); the
  interpreter's convert does not, so it clips."""
  if fmt in _SATFINITE and not interpret:
    return v.astype(fmt.dtype)
  v = jnp.where(jnp.isnan(v), v, jnp.minimum(jnp.maximum(v, -fmt.max),
                                             fmt.max))
  return v.astype(fmt.dtype)


def _reciprocal(s, interpret: bool):
  """``1 / s`` correctly rounded, in a kernel: PTX ``rcp.rn.f32`` (a Triton
  division is ``div.full.f32``, within 2 ulp); in the interpreter the host's
  IEEE division."""
  if interpret:
    return 1.0 / s
  from jax.experimental.pallas import triton as plgpu
  (r,) = plgpu.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[s], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])
  return r


def _divide(numerator: float, b, interpret: bool):
  """``numerator / b`` correctly rounded, in a kernel: PTX ``div.rn.f32`` (a
  Triton division is ``div.full.f32``); in the interpreter
  `scale_rules.rdivide_rn`."""
  if interpret:
    return scale_rules.rdivide_rn(numerator, b)
  from jax.experimental.pallas import triton as plgpu
  (q,) = plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[jnp.full_like(b, numerator), b],
      constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.float32)])
  return q


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
    a = blocks._amax_from_bits(  # noqa: SLF001
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
    _, plt = _pallas()
    plt.atomic_max(cur_ref, (jnp.int32(0),), jnp.max(_fp32_bits(v)))


def _te_copy(v, a, fmt: Format, margin: int, pow2: bool, interpret: bool):
  """(payload, stored scale ``1 / s``) of FP32 ``v`` scaled by TE's
  multiplier ``s`` of amax ``a`` (`scale_rules.unit_scales`, its divisions
  the kernel's), ``a`` broadcasting against ``v``."""
  mult = scale_rules.te_multiplier(
      a, fmt, margin=margin, pow2=pow2,
      divide=functools.partial(_divide, interpret=interpret))
  # NaN for a non-finite amax, said explicitly: the kernel's min need not
  # propagate it.
  mult = jnp.where(jnp.isfinite(a), mult, jnp.nan)
  return (_saturating_cast(v * mult, fmt, interpret),
          _divide(1.0, mult, interpret))


def _cast_call(shape: tuple[int, int], fmt: Format, margin: int, pow2: bool,
               history: int, found: bool, transpose: bool, interpret: bool):
  """`cast_transpose`'s kernel for a ``shape`` tensor (``history``: the
  delayed role's history length, 0 without one): a function of the amax
  ``(1,)``, the history and running amax if delayed, and the tensor. With
  ``found`` the amax is the first step's (`_first_amax_kernel`'s word),
  and each program writes its tile's amax into that word by an atomic max
  (`_found_amax`): it holds the whole tensor's on the first step already,
  and is read only then."""
  pl, plt = _pallas()
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
  pl, plt = _pallas()

  @pl.when(jnp.max(history_ref[...]) == 0)
  def _():
    def tile_max(k, m):
      v = t_ref[:, pl.ds(k * TILE, TILE)].astype(jnp.float32)
      return jnp.maximum(m, jnp.max(_fp32_bits(v)))
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
  pl, plt = _pallas()
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


# Each kernel entry point is jitted with its settings static: a train step
# calls it once per operand of every layer, and jit traces and lowers one
# kernel per shape instead of one per call.
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
    a = jnp.max(blocks._magnitude_bits(t))  # noqa: SLF001
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
  cur = blocks._amax_from_bits(outs[-1][0], jnp.float32)  # noqa: SLF001
  finite = jnp.isfinite(cur)
  running = running[0]
  return (q, qt, jnp.where(finite, outs[-2][0], jnp.nan),
          jnp.where(finite, jnp.maximum(running, cur), running))


def _row_amax_kernel(t_ref, r_ref, c_ref):
  mag = _fp32_bits(t_ref[...].astype(jnp.float32))
  r_ref[...] = jnp.max(mag, axis=1, keepdims=True)
  c_ref[...] = jnp.max(mag, axis=0, keepdims=True)


def _row_kernel(mr_ref, mc_ref, t_ref, q_ref, qt_ref, *, fmt: Format,
                interpret: bool):
  v = t_ref[...].astype(jnp.float32)
  q_ref[...] = _saturating_cast(v * mr_ref[...], fmt, interpret)
  qt_ref[...] = _saturating_cast(v * mc_ref[...], fmt, interpret).T


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
    a = blocks._amax_from_bits(jnp.max(bits, axis=axis, keepdims=True),  # noqa: SLF001
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
  pl, plt = _pallas()
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
  pl, plt = _pallas()
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


def mx_supported(shape: tuple[int, ...], fmt: Format, block_size: int) -> bool:
  """Whether `mx_cast_transpose` takes a 2-D ``shape`` tensor: whole
  ``block_size`` x ``block_size`` tiles of an FP8 element format in blocks
  of 32 (MX) or 128 (DeepSeek-V3 tiles), or of an FP6 one in blocks of 32
  (MXFP6)."""
  return (((block_size in (MX_BLOCK, TILE_BLOCK) and _fp8(fmt))
           or (block_size == MX_BLOCK and fmt.bits == 6))
          and _whole_tiles(shape, block_size))


MX_BLOCK = 32
TILE_BLOCK = 128
# DeepSeek-V3's floor on a tile's amax, as FP32 bits (a positive float's
# order is its bits' order).
_DEEPSEEK_FLOOR_BITS = int(np.float32(
    scale_rules._DEEPSEEK_AMAX_FLOOR).view(np.uint32))  # noqa: SLF001


def _block_scale(mag_max, fmt: Format, rule: str, interpret: bool):
  """(multiplier, what the QTensor stores: `_scales_out`'s input) of the
  blocks whose magnitude-bits max is ``mag_max``; `_block_values` or
  `_block_words` casts the scaled values.

  ``rule`` ``mx_floor``/``mx_rceil``: `qlayers.scale_rules.unit_scales` for
  MX (a NaN code multiplies by 0). ``deepseek_pow2``: DeepSeek-V3's scale
  ``max(amax, 1e-4) / 448`` correctly rounded, then up to a power of two
  (`scale_rules.deepseek_scale` with ``pow2``). That power is the RCEIL
  exponent of ``max(amax, 1e-4)``: an FP32 ``m`` has ``fl(m / max) <= 2**k``
  exactly when ``m <= max * 2**k`` (the next FP32 above ``max * 2**k`` is
  more than half an ulp of ``2**k`` away from it once divided), so it is
  read off the bits too; a non-finite tile multiplies by NaN, as the
  division by its NaN scale does. ``deepseek``: DeepSeek-V3's own FP32
  scale (`scale_rules.deepseek_scale`: its division by the constant is
  integer steps, which Triton compiles), multiplied by its correctly
  rounded reciprocal, as `scale_rules.unit_scales`; NaN for a non-finite
  tile.
  """
  if rule == "deepseek":
    scale = scale_rules.deepseek_scale(
        jax.lax.bitcast_convert_type(mag_max, jnp.float32), fmt, pow2=False)
    return _reciprocal(scale, interpret), scale
  return _pow2_multiplier(mag_max, fmt, rule)


def _block_values(x, mult, fmt: Format, interpret: bool):
  """The payload of scaled FP32 ``x`` (multiplier ``mult``): its saturating
  FP8 cast, or for FP6 its grid's values as E4M3
  (`qlayers.scaling.widened`; zeros in a block with a NaN scale)."""
  if fmt.bits == 6:
    return _zero_where_nan_scale(formats.round_on_grid(x, fmt),
                                 mult).astype(jnp.float8_e4m3fn)
  return _saturating_cast(x, fmt, interpret)


def _block_words(x, mult, fmt: Format, interpret: bool, hardware: bool):
  """`_block_values` of ``x (..., 4m)`` as uint32 words of four payload
  bytes along the last axis (byte ``j`` of word ``i``: element ``4i +
  j``), ``(..., m)``."""
  return _block_word(_quarters_last(x), mult, fmt, interpret, hardware)


def _block_word(parts, mult, fmt: Format, interpret: bool, hardware: bool):
  """`_block_values` of four FP32 arrays as one uint32 array, ``parts[j]``
  in byte ``j``. ``hardware``: by PTX conversions, two per word
  (`_FP8X4`; FP6 through FP16, `_FP6X4`)."""
  if not hardware:
    return functools.reduce(jnp.bitwise_or, (
        jax.lax.bitcast_convert_type(_block_values(
            p, mult, fmt, interpret), jnp.uint8).astype(jnp.uint32) << (8 * j)
        for j, p in enumerate(parts)))
  from jax.experimental.pallas import triton as plgpu
  ptx = (_FP6X4 if fmt.bits == 6 else _FP8X4).replace("FMT", fmt.name)
  (w,) = plgpu.elementwise_inline_asm(
      ptx, args=list(parts), constraints="=r" + ",f" * 4, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(parts[0].shape, jnp.int32)])
  w = jax.lax.bitcast_convert_type(w, jnp.uint32)
  return _zero_where_nan_scale(w, mult) if fmt.bits == 6 else w


def _pow2_multiplier(mag_max, fmt: Format, rule: str):
  """(multiplier, E8M0 code as uint32) of blocks whose magnitude-bits max is
  ``mag_max`` under an MX rule or ``deepseek_pow2`` (`_block_scale`)."""
  deepseek = rule == "deepseek_pow2"
  if deepseek:
    mag_max = jnp.maximum(mag_max, jnp.uint32(_DEEPSEEK_FLOOR_BITS))
  # uint32 codes: Triton widens uint8 arithmetic through 16 bits.
  c = scale_rules.mx_scale_codes(
      jax.lax.bitcast_convert_type(mag_max, jnp.float32), fmt,
      "mx_rceil" if deepseek else rule, dtype=jnp.uint32)
  # 2**(127 - code) from its bits (code 0: the subnormal 2**-127), as
  # scale_rules.unit_scales.
  mult = jax.lax.bitcast_convert_type(
      jnp.maximum((254 - c) << 23, jnp.uint32(0x400000)), jnp.float32)
  return jnp.where(c == 255, jnp.nan if deepseek else 0.0, mult), c


def _scales_out(codes, rule: str):
  """What the QTensor stores of `_pow2_multiplier`'s uint32 codes, or of
  ``deepseek``'s FP32 scales: E8M0 codes (MX), FP32 ``2**(code - 127)``
  (NaN for code 255) for DeepSeek-V3's power-of-two scales, the scales
  themselves (``deepseek``)."""
  if rule == "deepseek":
    return codes
  if rule != "deepseek_pow2":
    return codes.astype(jnp.uint8)
  return jnp.where(codes == 255, jnp.nan,
                   jax.lax.bitcast_convert_type(codes << 23, jnp.float32))


def _block_kernel(t_ref, q_ref, s_ref, qt_ref, st_ref, *, fmt: Format,
                  rule: str, interpret: bool, dequantized=(False, False),
                  hardware: bool = False):
  """One ``b x b`` tile ``v``: the copy of ``v`` and that of ``v.T``, each
  along its rows' blocks, as words of four payload bytes (`_block_words`)
  or dequantized to BF16."""
  v = t_ref[...].astype(jnp.float32)
  b = v.shape[0]
  for y, q, sc, dq in ((v, q_ref, s_ref, dequantized[0]),
                       (v.T, qt_ref, st_ref, dequantized[1])):
    if dq or fmt.bits == 8:
      # FP8 (and DeepSeek's tiles) by reductions: apart, MXFP8's blocks save
      # 10% of the kernel's instructions (0.5% of a predicted step) for
      # nearly three times the train step's traced operations, which its
      # compile time pays (benchmarks/RESULTS.md).
      # Block amaxes from the magnitude bits, as qlayers.blocks does: exact,
      # and an Inf or NaN element gives the 0xFF code.
      mult, s = _block_scale(jnp.max(_fp32_bits(y), axis=1, keepdims=True),
                             fmt, rule, interpret)
      x = y * mult
      q[...] = (_dequantized(_block_values(x, mult, fmt, interpret), s)
                if dq else _block_words(x, mult, fmt, interpret, hardware))
      sc[...] = _scales_out(s, rule)
      continue
    # An MXFP6 block's 32 elements apart: its amax and words in registers.
    parts = _split_last(y)
    mult, s = _block_scale(functools.reduce(
        jnp.maximum, (_fp32_bits(p) for p in parts)), fmt, rule, interpret)
    q[...] = _join_last([
        _block_word([p * mult for p in parts[k:k + 4]], mult, fmt, interpret,
                    hardware) for k in range(0, b, 4)])
    sc[...] = _scales_out(s, rule)[:, None]


def _dequantized(q, codes):
  """BF16 ``q * 2**(code - 127)`` (its block's E8M0 scale; NaN for code
  255), as `qlayers.scaling.dequantized` computes it: the product in FP32,
  then rounded to BF16."""
  return (q.astype(jnp.float32) * scale_rules.e8m0_decode(codes)
          ).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "block_size",
                                             "dequantized", "interpret"))
def mx_cast_transpose(t: jax.Array, fmt: Format | str, rule: str, *,
                      block_size: int = MX_BLOCK,
                      dequantized: tuple[bool, bool] = (False, False),
                      interpret: bool = False):
  """Both block-scaled copies of ``t (R, C)`` in one pass: ``(q, s, qt, st)``.

  ``q (R, C)`` with scales ``s (R, C / b)`` is ``t`` quantized along its
  rows' ``b``-blocks (`qlayers.scaling.quantize` along axis 1); ``qt (C, R)``
  with ``st (C, R / b)`` is ``t`` quantized along its columns' blocks (along
  axis 0), transposed. ``dequantized`` (for ``q``, for ``qt``; MX rules):
  that copy holds its BF16 dequantized values instead
  (`qlayers.scaling.dequantized`), for a GEMM on a GPU without MX tensor
  cores.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of ``block_size``.
    fmt: an FP8 element format (``"e4m3"``, ``"e5m2"``), or FP6
      (``"e2m3"``, ``"e3m2"``; MX rules), whose values are written as E4M3:
      `qlayers.scaling.widened`'s payload.
    rule: ``"mx_floor"``/``"mx_rceil"`` (MX: E8M0 codes, blocks of 32),
      ``"deepseek"`` (DeepSeek-V3 tiles of 128, `deepseek_v3`: FP32 scales)
      or ``"deepseek_pow2"`` (the same with power-of-two scales,
      `deepseek_v3_ue8m0`).
    block_size: 32 (MX) or 128 (DeepSeek-V3 tiles).
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt, st = mx_cast_transpose(jnp.ones((32, 64)), "e4m3",
    ...                                  "mx_rceil", interpret=True)
    >>> s.shape, qt.shape, st.shape, int(s[0, 0])
    ((32, 2), (64, 32), (64, 1), 119)
  """
  fmt = formats.get_format(fmt)
  b = block_size
  if not mx_supported(t.shape, fmt, b):
    raise ValueError(f"mx_cast_transpose takes a 2-D tensor whose dims are "
                     f"multiples of its blocks ({MX_BLOCK} or {TILE_BLOCK}, "
                     f"got {b}) and an FP8 format (FP6: blocks of "
                     f"{MX_BLOCK}); got {t.shape} and {fmt.name}.")
  dequantized = tuple(bool(d) for d in dequantized)
  if len(dequantized) != 2:
    raise ValueError(f"mx_cast_transpose's dequantized takes one flag per "
                     f"copy (2), got {dequantized!r}.")
  if (fmt.bits == 6 or any(dequantized)) and not rule.startswith("mx_"):
    raise ValueError(f"mx_cast_transpose takes FP6 or dequantized copies "
                     f"with an MX scale rule ('mx_rceil', 'mx_floor'), got "
                     f"{rule!r}.")
  q, s, qt, st = partition.cast(
      _mx_call, (fmt, rule, b, dequantized, _ptx_converts(fmt, interpret),
                 interpret), t,
      layouts=(((("r", 1), ("c", 1)) if dequantized[0] else
                (("r", 1), ("c", 4))), (("r", 1), ("c", b)),
               ((("c", 1), ("r", 1)) if dequantized[1] else
                (("c", 1), ("r", 4))), (("c", 1), ("r", b))), block=(b, b))
  payload = _payload_dtype(fmt)
  q, qt = (p if d else jax.lax.bitcast_convert_type(_words_to_bytes(p),
                                                    payload)
           for p, d in ((q, dequantized[0]), (qt, dequantized[1])))
  return q, s, qt, st


def _mx_call(shape: tuple[int, int], fmt: Format, rule: str, b: int,
             dequantized: tuple[bool, bool], hardware: bool,
             interpret: bool):
  """`mx_cast_transpose`'s kernel for a ``shape`` tensor: each copy as
  words of four payload bytes, or dequantized (BF16)."""
  pl, plt = _pallas()
  rows, cols = shape
  sdtype = jnp.float32 if rule.startswith("deepseek") else jnp.uint8

  def copy(r, c, dq):  # an (r, c) copy's shape and dtype, its tiles' shape
    return (jax.ShapeDtypeStruct((r, c), jnp.bfloat16), (b, b)) if dq else (
        jax.ShapeDtypeStruct((r, c // 4), jnp.uint32), (b, b // 4))

  (q, q_tile), (qt, qt_tile) = (copy(rows, cols, dequantized[0]),
                                copy(cols, rows, dequantized[1]))
  return pl.pallas_call(
      functools.partial(_block_kernel, fmt=fmt, rule=rule,
                        interpret=interpret, dequantized=dequantized,
                        hardware=hardware),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec(q_tile, lambda i, j: (i, j)),
                 pl.BlockSpec((b, 1), lambda i, j: (i, j)),
                 pl.BlockSpec(qt_tile, lambda i, j: (j, i)),
                 pl.BlockSpec((b, 1), lambda i, j: (j, i))],
      out_shape=[q, jax.ShapeDtypeStruct((rows, cols // b), sdtype),
                 qt, jax.ShapeDtypeStruct((cols, rows // b), sdtype)],
      compiler_params=plt.CompilerParams(num_warps=1 if b <= 32 else 8),
      interpret=interpret, name="qlayers_mx_cast_transpose")


def _square_kernel(t_ref, q_ref, s_ref, qt_ref, *, fmt: Format, rule: str,
                   interpret: bool):
  v = t_ref[...].astype(jnp.float32)
  mag = jax.lax.bitcast_convert_type(v, jnp.uint32) & 0x7FFFFFFF
  tile_max = jnp.max(jnp.max(mag, axis=1, keepdims=True), axis=0,
                     keepdims=True)
  mult, c = _block_scale(tile_max, fmt, rule, interpret)
  q = _block_values(v * mult, mult, fmt, interpret)
  q_ref[...] = q
  qt_ref[...] = q.T
  s_ref[...] = _scales_out(c, rule)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "pow2",
                                             "interpret"))
def block_cast_transpose(t: jax.Array, fmt: Format | str, *,
                         block_size: int = TILE_BLOCK, pow2: bool = True,
                         interpret: bool = False):
  """``t (R, C)`` quantized in square ``block_size`` blocks with
  DeepSeek-V3's scales (``pow2``: power-of-two, `deepseek_v3_ue8m0`'s
  weights; else `deepseek_v3`'s), in both layouts at once: ``(q, s, qt)``,
  ``s (R / b, C / b)`` FP32.

  Square blocks quantize ``t`` and ``t.T`` alike, so one scale per block
  serves both copies (`qlayers.scaling.quantize` along either axis).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt = block_cast_transpose(jnp.ones((128, 256)), "e4m3",
    ...                                 interpret=True)
    >>> s.shape, qt.shape, float(s[0, 0]) == 2.0**-8
    ((1, 2), (256, 128), True)
  """
  fmt = formats.get_format(fmt)
  b = block_size
  if not mx_supported(t.shape, fmt, b) or b != TILE_BLOCK:
    raise ValueError(f"block_cast_transpose takes a 2-D tensor whose dims "
                     f"are multiples of {TILE_BLOCK} and an FP8 format; got "
                     f"{t.shape}, blocks of {b} and {fmt.name}.")
  return tuple(partition.cast(
      _block_call, (fmt, pow2, interpret), t,
      layouts=(partition.LIKE_T, (("r", b), ("c", b)), partition.LIKE_T_T),
      block=(b, b)))


def _block_call(shape: tuple[int, int], fmt: Format, pow2: bool,
                interpret: bool):
  """`block_cast_transpose`'s kernel for a ``shape`` tensor."""
  pl, plt = _pallas()
  rows, cols = shape
  b = TILE_BLOCK
  return pl.pallas_call(
      functools.partial(_square_kernel, fmt=fmt,
                        rule="deepseek_pow2" if pow2 else "deepseek",
                        interpret=interpret),
      grid=(rows // b, cols // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((b, b), lambda i, j: (i, j)),
                 pl.BlockSpec((1, 1), lambda i, j: (i, j)),
                 pl.BlockSpec((b, b), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
                 jax.ShapeDtypeStruct((rows // b, cols // b), jnp.float32),
                 jax.ShapeDtypeStruct((cols, rows), fmt.dtype)],
      compiler_params=plt.CompilerParams(num_warps=8),
      interpret=interpret, name="qlayers_block_cast_transpose")


def fp4_supported(shape: tuple[int, ...], fmt: Format,
                  block_size: int) -> bool:
  """Whether `fp4_cast_transpose` takes a 2-D ``shape`` tensor: MXFP4 (E2M1,
  blocks of 32) in whole 32 x 32 tiles."""
  return (len(shape) == 2 and fmt is formats.E2M1 and block_size == MX_BLOCK
          and all(d >= MX_BLOCK and d % MX_BLOCK == 0 for d in shape))


def fp4_transforms(hadamard) -> bool:
  """Whether `fp4_cast_transpose` takes these ``(size, size)`` transforms:
  each 0 or a Hadamard block size that divides a 32 x 32 tile."""
  return (len(tuple(hadamard)) == 2
          and all(s == 0 or (s in hadamard_lib.SIZES and s <= MX_BLOCK)
                  for s in hadamard))


def _fp4_kernel(*refs, rule: str, stochastic: bool, hadamard=(0, 0),
                hardware: bool = False):
  """One 32 x 32 tile: the copy along axis 1 of ``v`` (transformed along its
  rows' blocks of ``hadamard[0]``) and the copy of ``v.T`` (along ``v``'s
  columns' blocks of ``hadamard[1]``; 0: none), as uint32 words of eight
  codes (`_block_e2m1_words`, converted by PTX where ``hardware``)."""
  if stochastic:
    origin_ref, key_ref, t_ref, q_ref, s_ref, qt_ref, st_ref = refs
  else:
    t_ref, q_ref, s_ref, qt_ref, st_ref = refs
  pl, _ = _pallas()
  v = t_ref[...].astype(jnp.float32)
  b = v.shape[0]
  copies = [v, v.T]
  if stochastic:  # this tile's place in t: its shard's (`origin`) and in it
    rows, cols = origin_ref[2], origin_ref[3]
    i, j = (origin_ref[a] + pl.program_id(a).astype(jnp.uint32) * b
            for a in (0, 1))
    down = jax.lax.broadcasted_iota(jnp.uint32, (b,), 0)
  for c, (y, q, sc) in enumerate(zip(copies, (q_ref, qt_ref),
                                     (s_ref, st_ref))):
    # A row's 32 elements apart: its transform, amax and four words in
    # registers.
    parts = _split_last(y)
    if hadamard[c]:
      parts = _transform_parts(parts, hadamard[c])
    mag = functools.reduce(jnp.maximum,
                           (_doubled_bits(p) for p in parts)) >> 1
    mult, code = _pow2_multiplier(mag, formats.E2M1, rule)
    u = None
    if stochastic:
      # Each copy draws the random bytes of its own places (`threefry`):
      # word w of a row is the hash at column w of its eighths, whose bytes
      # are its elements' (a row's counter product computed once).
      row, col, width = ((i + down, j >> 3, cols >> 3) if c == 0
                         else (j + down, i >> 3, rows >> 3))
      u = [byte for w in range(b // 8) for byte in threefry.eighths_at(
          key_ref[2 * c], key_ref[2 * c + 1], row, col + w, width,
          rotl=_rotl_wide if hardware else None)]
    q[...] = _join_last(_block_e2m1_words(parts, mult, u, hardware))
    sc[...] = _scales_out(code, rule)[:, None]


@functools.partial(jax.jit, static_argnames=("rule", "hadamard", "interpret"))
def fp4_cast_transpose(t: jax.Array, rule: str = "mx_rceil", *,
                       keys: tuple[jax.Array, jax.Array] | None = None,
                       hadamard: tuple[int, int] = (0, 0),
                       interpret: bool = False):
  """Both MXFP4 copies of ``t (R, C)`` in one pass: ``(q, s, qt, st)``.

  ``q (R, C / 2)`` packed E2M1 with E8M0 scales ``s (R, C / 32)`` is
  `qlayers.scaling.quantize` of ``t`` along axis 1; ``qt (C, R / 2)`` with
  ``st (C, R / 32)`` is that of ``t.T`` along axis 1 (the copy packed along
  ``t``'s rows, as the GEMM contracting them takes it). With ``keys``
  each copy rounds stochastically with the random bytes
  `qlayers.formats.round_to_format` draws from its key. ``hadamard``: the
  block sizes of `qlayers.hadamard.transform` applied to each copy first
  (``q``'s along ``t``'s columns, ``qt``'s along its rows; 0: none), as the
  Hadamard recipes' gradient GEMMs take them.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of 32.
    rule: ``"mx_rceil"`` or ``"mx_floor"``.
    keys: None (round to nearest even) or the PRNG keys of the two copies
      (Threefry, as `qlayers.formats.rounding_key` makes them).
    hadamard: ``(size for q, size for qt)``, each 0 or a power of two from
      2 to 32.
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt, st = fp4_cast_transpose(jnp.ones((32, 64)), interpret=True)
    >>> q.shape, s.shape, qt.shape, st.shape, int(q[0, 0])
    ((32, 32), (32, 2), (64, 16), (64, 1), 102)
  """
  if not fp4_supported(t.shape, formats.E2M1, MX_BLOCK):
    raise ValueError(f"fp4_cast_transpose takes a 2-D tensor whose dims "
                     f"are multiples of {MX_BLOCK}; got {t.shape}.")
  if keys is not None and len(keys) != 2:
    raise ValueError(f"fp4_cast_transpose takes one PRNG key per copy (2), "
                     f"got {len(keys)}.")
  if rule not in ("mx_rceil", "mx_floor"):
    raise ValueError(f"fp4_cast_transpose takes an MX scale rule "
                     f"('mx_rceil', 'mx_floor'), got {rule!r}.")
  if not fp4_transforms(hadamard):
    raise ValueError(f"fp4_cast_transpose's hadamard takes two sizes, each "
                     f"0 or a power of two up to {MX_BLOCK}; got "
                     f"{hadamard!r}.")
  b = MX_BLOCK
  args = [t]
  if keys is not None:
    args.insert(0, jnp.concatenate([threefry.key_words(k) for k in keys]))
  q, s, qt, st = partition.cast(
      _fp4_call, (rule, keys is not None, tuple(hadamard),
                  _ptx_converts(formats.E2M1, interpret), interpret), *args,
      layouts=((("r", 1), ("c", 8)), (("r", 1), ("c", b)),
               (("c", 1), ("r", 8)), (("c", 1), ("r", b))),
      block=(b, b), origin=keys is not None)
  return _words_to_bytes(q), s, _words_to_bytes(qt), st


def _fp4_call(shape: tuple[int, int], rule: str, stochastic: bool,
              hadamard: tuple[int, int], hardware: bool, interpret: bool):
  """`fp4_cast_transpose`'s kernel for a ``shape`` tensor: a function of
  (with ``stochastic``: the shard's origin in t and the keys' words,) the
  tensor."""
  pl, plt = _pallas()
  rows, cols = shape
  b, w = MX_BLOCK, MX_BLOCK // 8  # a tile row's words of eight codes
  in_specs = [pl.BlockSpec((b, b), lambda i, j: (i, j))]
  if stochastic:
    in_specs = [pl.BlockSpec((4,), lambda i, j: (0,))] * 2 + in_specs
  return pl.pallas_call(
      functools.partial(_fp4_kernel, rule=rule, stochastic=stochastic,
                        hadamard=hadamard, hardware=hardware),
      grid=(rows // b, cols // b),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((b, w), lambda i, j: (i, j)),
                 pl.BlockSpec((b, 1), lambda i, j: (i, j)),
                 pl.BlockSpec((b, w), lambda i, j: (j, i)),
                 pl.BlockSpec((b, 1), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols // 8), jnp.uint32),
                 jax.ShapeDtypeStruct((rows, cols // b), jnp.uint8),
                 jax.ShapeDtypeStruct((cols, rows // 8), jnp.uint32),
                 jax.ShapeDtypeStruct((cols, rows // b), jnp.uint8)],
      compiler_params=plt.CompilerParams(num_warps=1),
      interpret=interpret, name="qlayers_fp4_cast_transpose")


# NVFP4: E2M1 in blocks of 16 with E4M3 scales under a per-tensor FP32 scale.
NV_BLOCK = 16


def nvfp4_supported(shape: tuple[int, ...]) -> bool:
  """Whether `nvfp4_cast_transpose` takes a 2-D ``shape`` tensor: both dims
  multiples of 16."""
  return (len(shape) == 2
          and all(d >= NV_BLOCK and d % NV_BLOCK == 0 for d in shape))


def _encode_scales(amax, interpret: bool):
  """NVFP4's per-tensor ``(S_enc, S_dec, amax finite)`` in a kernel:
  `qlayers.scale_rules.nvfp4_encode_scale` and its correctly rounded
  reciprocal."""
  s = jnp.minimum(_divide(scale_rules.NVFP4_RANGE, amax, interpret),
                  scale_rules._F32_MAX)  # noqa: SLF001
  s_enc = jnp.where((amax == 0) | (s == 0), 1.0, s)
  return s_enc, _divide(1.0, s_enc, interpret), jnp.isfinite(amax)


def _nvfp4_blocks(mag_max, levels, interpret: bool):
  """(multiplier, E4M3 scale as FP32) of blocks whose largest magnitude
  bits are ``mag_max``: `qlayers.scale_rules.nvfp4_scales`, in a
  kernel."""
  s_enc, s_dec, finite_tensor = levels
  amax = blocks._amax_from_bits(mag_max, jnp.float32)  # noqa: SLF001
  block = amax * (s_enc * scale_rules._F32_SIXTH)  # noqa: SLF001
  e4m3 = _saturating_cast(block, formats.E4M3, interpret).astype(
      jnp.float32)
  mult = jnp.minimum(_divide(1.0, e4m3 * s_dec, interpret),
                     scale_rules._F32_MAX)  # noqa: SLF001
  finite = jnp.isfinite(amax) & finite_tensor
  return jnp.where(finite, mult, 0.0), jnp.where(finite, e4m3, jnp.nan)


def _e2m1_codes(x, r=None, hardware: bool = False):
  """`qlayers.formats.cast` of FP32 ``x`` to E2M1 codes (uint32), rounding
  to nearest even, or stochastically with random bytes ``r``, in a kernel
  (`qlayers.formats.grid_codes`). ``hardware``: the steps are truncated by
  PTX's own conversion (`_TRUNCATE_U32`) and the NaN test is left out: a
  kernel's ``x`` is NaN only in a block with a NaN scale, whose codes it
  writes as zeros (`_zero_where_nan_scale`). The same codes."""
  if not hardware:
    return formats.grid_codes(x, formats.E2M1, r)
  return formats.grid_codes(x, formats.E2M1, r, truncate=_truncate_u32,
                            nan=False)


# PTX's float-to-integer conversions saturate (NaN gives 0; PTX ISA, cvt),
# where Pallas clamps the value first, in two more instructions.
_TRUNCATE_U32 = "cvt.rzi.u32.f32 $0, $1;"


def _truncate_u32(v):
  """FP32 ``v >= 0`` truncated to uint32 in a kernel, by `_TRUNCATE_U32`."""
  from jax.experimental.pallas import triton as plgpu
  (k,) = plgpu.elementwise_inline_asm(
      _TRUNCATE_U32, args=[v], constraints="=r,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(k, jnp.uint32)


# A Threefry rotation as one wide multiply and an or: x * 2**d in 64 bits
# holds x << d in its low word and x >> (32 - d) in its high one. The
# multiply runs on the FMA pipe, the funnel shift it replaces on the ALU
# pipe that the stochastic kernels' other integer work fills (SASS counts,
# benchmarks/RESULTS.md); the xor after it folds the or into one LOP3.
_ROTL_WIDE = ("{ .reg .b64 w; .reg .b32 lo, hi; mul.wide.u32 w, $1, %d; "
              "mov.b64 {lo, hi}, w; or.b32 $0, lo, hi; }")


def _rotl_wide(x, d: int):
  """uint32 ``x`` rotated left by ``d`` bits in a kernel, by `_ROTL_WIDE`:
  `qlayers.threefry`'s rotation, the same bits."""
  from jax.experimental.pallas import triton as plgpu
  (k,) = plgpu.elementwise_inline_asm(
      _ROTL_WIDE % (1 << d), args=[jax.lax.bitcast_convert_type(x, jnp.int32)],
      constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(k, jnp.uint32)


def _fp32_bits(v):
  return jax.lax.bitcast_convert_type(v, jnp.uint32) & 0x7FFFFFFF


def _doubled_bits(v):
  """`_fp32_bits` shifted up one: the sign dropped by a multiply, which
  runs on the FMA pipe where the mask would take the ALU's; ordered as
  the magnitudes, so a block's max shifted back down is their max's."""
  return jax.lax.bitcast_convert_type(v, jnp.uint32) * jnp.uint32(2)


def _ptx_converts(fmt: Format, interpret: bool) -> bool:
  """Whether a kernel casts FP32 to ``fmt`` with PTX conversions of its own
  (`_block_words`, `_e2m1_word`): compiled for a GPU
  (`qlayers.table.gpu_arch`) that has them, sm_89 for FP8, sm_100 (its
  ``a`` features) for FP6 and FP4. The interpreter and an unknown GPU take
  Triton's casts and `qlayers.formats`' FP32 steps, the same values."""
  sm = 0 if interpret else table.sm_version(table.gpu_arch("cuda"))
  return sm >= (89 if fmt.bits == 8 else 100)


def _pairs_last(x):
  """``x (..., 2m)`` as its even and odd elements along the last axis, each
  ``(..., m)`` (a split of a trailing axis of 2: Triton has no strided
  slices)."""
  pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  return tuple(p[..., 0] for p in jnp.split(pairs, 2, axis=-1))


def _quarters_last(x):
  """``x (..., 4m)`` as the four ``(..., m)`` arrays of its elements ``4i +
  j``, ``j = 0..3`` in turn."""
  even, odd = _pairs_last(x)
  (e0, e2), (e1, e3) = _pairs_last(even), _pairs_last(odd)
  return [e0, e1, e2, e3]


# PTX's two-value conversions put their first source in the high half of
# the result (PTX ISA, cvt: ".e2m1x2", ".e2m3x2"), so the odd element goes
# first. NaN converts to the largest positive value (CUDA's cuda_fp4.hpp
# and cuda_fp6.hpp say so of their host twins); a kernel's NaN comes only
# from a block with a NaN scale, whose payload it writes as zeros
# (`_zero_where_nan_scale`).
_E2M1X8 = ("{ .reg .b8 b0, b1, b2, b3; "
           "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1; "
           "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3; "
           "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5; "
           "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7; "
           "mov.b32 $0, {b0, b1, b2, b3}; }")
_FP8X4 = ("{ .reg .b16 lo, hi; "
          "cvt.rn.satfinite.FMTx2.f32 lo, $2, $1; "
          "cvt.rn.satfinite.FMTx2.f32 hi, $4, $3; "
          "mov.b32 $0, {lo, hi}; }")
# FP6 to FP16 and FP16 to E4M3 are exact.
_FP6X4 = ("{ .reg .b16 p0, p1, lo, hi; .reg .b32 h0, h1; "
          "cvt.rn.satfinite.FMTx2.f32 p0, $2, $1; "
          "cvt.rn.f16x2.FMTx2 h0, p0; "
          "cvt.rn.satfinite.e4m3x2.f16x2 lo, h0; "
          "cvt.rn.satfinite.FMTx2.f32 p1, $4, $3; "
          "cvt.rn.f16x2.FMTx2 h1, p1; "
          "cvt.rn.satfinite.e4m3x2.f16x2 hi, h1; "
          "mov.b32 $0, {lo, hi}; }")
def _e2m1_word(parts, r=None, hardware: bool = False):
  """E2M1 codes of eight FP32 arrays as one uint32 array, ``parts[j]``'s in
  bits ``4j`` to ``4j + 3`` (as bytes, the packed payload, low nibble
  first). Rounded to nearest even, or stochastically with random bytes
  ``r[j]`` (`qlayers.threefry.hash_bytes`; `qlayers.formats.grid_codes`).
  ``hardware``: to nearest by four PTX ``cvt.rn.satfinite.e2m1x2.f32``,
  which round to nearest even and saturate as `grid_codes` does (+-0 keeps
  its sign; NaN aside, see `_E2M1X8`), the same words. Words, not bytes:
  Triton widens each byte to 16 and 32 bits to store it."""
  if not hardware or r is not None:
    r = r or [None] * 8
    return functools.reduce(jnp.bitwise_or, (
        _e2m1_codes(part, r[j], hardware) << (4 * j)
        for j, part in enumerate(parts)))
  from jax.experimental.pallas import triton as plgpu
  (w,) = plgpu.elementwise_inline_asm(
      _E2M1X8, args=list(parts), constraints="=r" + ",f" * 8, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(parts[0].shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(w, jnp.uint32)


def _block_e2m1_words(parts, mult, r, hardware: bool):
  """The E2M1 words of blocks held apart (``parts``: their elements, one
  array each, `_split_last`) scaled by ``mult``, as a list: eight codes to
  a word (`_e2m1_word`; ``r``: the elements' random bytes, one array each,
  or None), zeros where the scale is NaN (`_zero_where_nan_scale`)."""
  return [_zero_where_nan_scale(_e2m1_word(
      [p * mult for p in parts[k:k + 8]], r and r[k:k + 8], hardware), mult)
          for k in range(0, len(parts), 8)]


def _words_to_bytes(words):
  """uint32 ``(..., m)`` -> its little-endian bytes ``(..., 4m)`` (in XLA,
  a view)."""
  b = jax.lax.bitcast_convert_type(words, jnp.uint8)
  return b.reshape(*words.shape[:-1], 4 * words.shape[-1])


def _zero_where_nan_scale(payload, mult):
  """``payload`` with zeros in the blocks whose multiplier ``mult`` (one per
  row, broadcasting) is 0: those with a NaN scale (`qlayers.scaling`'s
  packed payloads hold zeros there)."""
  return jnp.where(mult == 0, jnp.zeros((), payload.dtype), payload)


def _butterfly_last(y):
  """`qlayers.hadamard.butterfly` along the last axis (16) of a kernel's
  array, with the same pairs and order of additions: each stage pairs
  elements ``r`` and ``r + 8`` and writes their sum and difference to
  ``2r`` and ``2r + 1``, so after the four stages (the pairs ``h = 8, 4,
  2, 1`` apart of the in-place transform, in turn) each element is back in
  its place. Splits and joins of a trailing axis of 2 are what Triton has
  instead of slices."""
  lead, n = y.shape[:-1], y.shape[-1]
  for _ in range(n.bit_length() - 1):
    pairs = jnp.swapaxes(y.reshape(*lead, 2, n // 2), -1, -2)
    a, b = (p[..., 0] for p in jnp.split(pairs, 2, axis=-1))
    y = jnp.stack([a + b, a - b], axis=-1).reshape(*lead, n)
  return y


def _signs_last(shape):
  """`qlayers.hadamard.random_signs` (of the last axis' length) along the
  last axis of ``shape``, from an iota and a 32-bit mask per 32 signs (a
  kernel has no array constants)."""
  negative = hadamard_lib.random_signs(shape[-1]) < 0
  k = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  flip = jnp.zeros(shape, jnp.uint32)
  for word in range(0, shape[-1], 32):
    mask = sum(1 << i for i, neg in enumerate(negative[word:word + 32])
               if neg)
    bits = (jnp.uint32(mask) >> ((k - word) & 31)) & 1
    flip = jnp.where((k >= word) & (k < word + 32), bits, flip)
  return 1.0 - 2.0 * flip.astype(jnp.float32)


def _transform_last(y):
  """`qlayers.hadamard.transform` along the last axis of a kernel's FP32
  array: the signs, the butterfly, the factor."""
  size = y.shape[-1]
  return _butterfly_last(y * _signs_last(y.shape)) * hadamard_lib._norm(size)  # noqa: SLF001


def _split_last(x):
  """``x (..., n)`` as its ``n`` elements along the last axis, each an
  ``(..., 1)``-less array, in order (halvings of the trailing axis)."""
  parts = [x]
  while parts[0].shape[-1] > 1:
    parts = [half for p in parts for half in _pairs_last(p)]
  n = x.shape[-1]
  bits = n.bit_length() - 1  # part k holds element k's bits reversed
  return [parts[int(f"{j:0{bits}b}"[::-1], 2)][..., 0] for j in range(n)]


def _join_last(parts):
  """``n`` arrays (a power of two) -> ``(..., n)``, ``parts[j]`` at ``j``,
  by joins of pairs (the inverse of `_split_last`)."""
  parts = [p[..., None] for p in parts]
  while len(parts) > 1:
    parts = [jnp.swapaxes(jnp.stack(parts[k:k + 2], axis=-1), -1, -2
                          ).reshape(*parts[k].shape[:-1], -1)
             for k in range(0, len(parts), 2)]
  return parts[0]


def _transform_parts(parts, size: int, norm: bool = True):
  """`qlayers.hadamard.transform` over each ``size`` consecutive arrays of
  the list ``parts`` (a kernel's elements apart, `_split_last`): the
  signs, `qlayers.hadamard.butterfly`'s stages (the same pairs and sums,
  in registers) and, with ``norm``, the factor."""
  signs = hadamard_lib.random_signs(size)
  factor = hadamard_lib._norm(size)  # noqa: SLF001
  out = []
  for start in range(0, len(parts), size):
    block = [-p if sign < 0 else p
             for p, sign in zip(parts[start:start + size], signs)]
    h = size // 2
    while h:
      for g in range(0, size, 2 * h):
        for i in range(g, g + h):
          block[i], block[i + h] = block[i] + block[i + h], block[i] - block[i + h]
      h //= 2
    out += [p * factor for p in block] if norm else block
  return out


def _lane_groups_max(x, size: int):
  """The max of each ``size`` consecutive elements of 1-D ``x`` (a kernel's
  lanes), in each of them."""
  n = x.shape[0]
  m = jnp.max(x.reshape(n // size, size), axis=1, keepdims=True)
  return jnp.broadcast_to(m, (n // size, size)).reshape(n)


def _nvfp4_kernel(*refs, square: bool, hadamard: bool, stochastic: bool,
                  interpret: bool, hardware: bool = False):
  """One tile ``v`` (rows and columns each 16 or 32; one warp): the copy of
  ``v`` along its rows and that of ``v.T`` (of its 16-point transform along
  ``t``'s rows if ``hadamard``), each row's elements apart
  (`_split_last`), so a block's amax, transform, scale and words run in
  registers; eight E2M1 codes to a word (`_e2m1_word`), as the MXFP4
  kernel does. With ``square``, 16 x 16 blocks: a block's amax is then
  over its 16 lanes too, one scale per block (one tensor amax)."""
  if stochastic:
    origin_ref, key_ref, *refs = refs
  amaxes, (t_ref, q_ref, s_ref, qt_ref, st_ref) = refs[:-5], refs[-5:]
  levels = [_encode_scales(jnp.reshape(a[...], (1,)), interpret)
            for a in amaxes]  # the copies' (square: one for both)
  pl, _ = _pallas()
  v = t_ref[...].astype(jnp.float32)
  if stochastic:  # this tile's place in t: its shard's (`origin`) and in it
    rows, cols = origin_ref[2], origin_ref[3]
    i, j = (origin_ref[a] + pl.program_id(a).astype(jnp.uint32) * v.shape[a]
            for a in (0, 1))
  for c, (y, q, sc) in enumerate(((v, q_ref, s_ref), (v.T, qt_ref, st_ref))):
    parts, lanes = _split_last(y), y.shape[0]
    if c and hadamard:
      parts = _transform_parts(parts, NV_BLOCK)
    u = None
    if stochastic:
      # Each copy draws the random bytes of its own places (`threefry`):
      # word w of a row is the hash at column w of its eighths.
      down = jax.lax.broadcasted_iota(jnp.uint32, (lanes,), 0)
      row, col, width = ((i + down, j >> 3, cols >> 3) if c == 0
                         else (j + down, i >> 3, rows >> 3))
      u = [byte for w in range(len(parts) // 8) for byte in
           threefry.eighths_at(key_ref[2 * c], key_ref[2 * c + 1], row,
                               col + w, width,
                               rotl=_rotl_wide if hardware else None)]
    words, scales = [], []
    for k in range(0, len(parts), NV_BLOCK):
      block = parts[k:k + NV_BLOCK]
      mag = functools.reduce(jnp.maximum, (_fp32_bits(p) for p in block))
      mult, e4m3 = _nvfp4_blocks(
          _lane_groups_max(mag, NV_BLOCK) if square else mag,
          levels[c % len(levels)], interpret)
      words += _block_e2m1_words(block, mult, u and u[k:k + NV_BLOCK],
                                 hardware)
      # A 16 x 16 block's lanes hold its one scale.
      scales.append(jnp.max(e4m3.reshape(lanes // NV_BLOCK, NV_BLOCK),
                            axis=1) if square else e4m3)
    q[...] = _join_last(words)
    sc[...] = _join_last(scales).astype(jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("square", "hadamard",
                                             "interpret"))
def nvfp4_cast_transpose(t: jax.Array, amax: jax.Array | None = None,
                         amax_t: jax.Array | None = None, *,
                         square: bool = False, hadamard: bool = False,
                         keys: tuple[jax.Array, jax.Array] | None = None,
                         interpret: bool = False):
  """NVFP4's two copies of ``t (R, C)`` in one pass: ``(q, s, qt, st)``,
  E2M1 codes packed two per byte and their E4M3 block scales.

  ``q (R, C / 2)`` is `qlayers.scaling.quantize` of ``t`` along axis 1 with
  the ``nvfp4`` rule; ``qt (C, R / 2)`` that of ``t.T`` (the copy packed
  along ``t``'s rows, as the GEMM contracting them takes it), of the
  16-point `qlayers.hadamard.transform` of ``t`` along its rows if
  ``hadamard``. Blocks of 1 x 16 (``s (R, C / 16)``, ``st (C, R / 16)``),
  or with ``square`` 16 x 16 blocks shared by both copies (``s (R / 16,
  C / 16)``, ``st`` its transpose). The kernel computes the per-tensor
  scales from the amaxes (IEEE divisions) and each block's scale.

  Args:
    t: 2-D BF16/FP16/FP32 array, both dims multiples of 16.
    amax: the tensor amax that scales ``q`` (FP32 scalar); None: ``t``'s.
    amax_t: that of ``qt`` (not with ``square``); None: that of the
      tensor it is made of (``t``, or its transform).
    square: 16 x 16 blocks (NVFP4's weights); round to nearest even only.
    hadamard: ``qt`` of the transformed ``t`` (not with ``square``).
    keys: None (round to nearest even) or the PRNG keys of the two copies
      (Threefry, as `qlayers.formats.rounding_key` makes them).
    interpret: run in Pallas' interpreter (any platform; for tests).

  Example:
    >>> import jax.numpy as jnp
    >>> q, s, qt, st = nvfp4_cast_transpose(jnp.ones((32, 64)),
    ...                                     interpret=True)
    >>> q.shape, s.shape, qt.shape, st.shape, int(q[0, 0]), float(s[0, 0])
    ((32, 32), (32, 4), (64, 16), (64, 2), 119, 448.0)
  """
  if not nvfp4_supported(t.shape):
    raise ValueError(f"nvfp4_cast_transpose takes a 2-D tensor whose dims "
                     f"are multiples of {NV_BLOCK}; got {t.shape}.")
  if square and (hadamard or keys is not None or amax_t is not None):
    raise ValueError("nvfp4_cast_transpose with square blocks takes one "
                     "amax and rounds to nearest even, with no transform.")
  if keys is not None and len(keys) != 2:
    raise ValueError(f"nvfp4_cast_transpose takes one PRNG key per copy "
                     f"(2), got {len(keys)}.")
  b = NV_BLOCK

  def tensor_amax(a, of):
    return blocks.amax(of()) if a is None else jnp.asarray(a, jnp.float32)

  args = [jnp.reshape(tensor_amax(amax, lambda: t), (1,))]
  if not square:
    args.append(jnp.reshape(tensor_amax(amax_t, lambda: (
        hadamard_lib.transform(t, b) if hadamard else t)), (1,)))
  if keys is not None:
    args.insert(0, jnp.concatenate([threefry.key_words(k) for k in keys]))
  scales = ((("r", b), ("c", b)), (("c", b), ("r", b))) if square else (
      (("r", 1), ("c", b)), (("c", 1), ("r", b)))
  q, s, qt, st = partition.cast(
      _nvfp4_call, (square, hadamard, keys is not None,
                    _ptx_converts(formats.E2M1, interpret), interpret), *args, t,
      layouts=((("r", 1), ("c", 8)), scales[0], (("c", 1), ("r", 8)),
               scales[1]),
      block=(b, b), origin=keys is not None)
  return _words_to_bytes(q), s, _words_to_bytes(qt), st


def _nvfp4_call(shape: tuple[int, int], square: bool, hadamard: bool,
                stochastic: bool, hardware: bool, interpret: bool):
  """`nvfp4_cast_transpose`'s kernel for a ``shape`` tensor: a function of
  (with ``stochastic``: the shard's origin in t and the keys' words,) the
  amaxes and the tensor, returning its four 2-D results."""
  pl, plt = _pallas()
  rows, cols = shape
  # Tiles of 32 where the dims allow (a warp's lanes each hold a row),
  # else 16; a scale per 16 x 16 block (square) or per 1 x 16.
  tr, tc = (32 if d % 32 == 0 else NV_BLOCK for d in shape)
  b, m, e4m3 = NV_BLOCK, NV_BLOCK if square else 1, jnp.float8_e4m3fn
  one = pl.BlockSpec((1,), lambda i, j: (0,))
  in_specs = [one] if square else [one, one]
  if stochastic:
    in_specs = [pl.BlockSpec((4,), lambda i, j: (0,))] * 2 + in_specs
  return pl.pallas_call(
      functools.partial(_nvfp4_kernel, square=square, hadamard=hadamard,
                        stochastic=stochastic, interpret=interpret,
                        hardware=hardware),
      grid=(rows // tr, cols // tc),
      in_specs=in_specs + [pl.BlockSpec((tr, tc), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((tr, tc // 8), lambda i, j: (i, j)),
                 pl.BlockSpec((tr // m, tc // b), lambda i, j: (i, j)),
                 pl.BlockSpec((tc, tr // 8), lambda i, j: (j, i)),
                 pl.BlockSpec((tc // m, tr // b), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols // 8), jnp.uint32),
                 jax.ShapeDtypeStruct((rows // m, cols // b), e4m3),
                 jax.ShapeDtypeStruct((cols, rows // 8), jnp.uint32),
                 jax.ShapeDtypeStruct((cols // m, rows // b), e4m3)],
      compiler_params=plt.CompilerParams(num_warps=1),
      interpret=interpret, name="qlayers_nvfp4_cast_transpose")


def _nvfp4_amax_kernel(t_ref, a_ref, at_ref, *, tile_rows: int):
  """``tile_rows`` rows of ``t`` (one warp), in tiles as `_nvfp4_kernel`'s
  (rows and columns each 16 or 32), each lane a column of a tile with its
  rows apart (`_split_last`), so the 16-point transform along the rows
  runs in registers: the magnitude-bit maxima of each 16 columns, of ``t``
  and of its transform. The transform's factor, a power of two, scales
  the maxima rather than each element: a product rounds monotonically, so
  the max of the scaled magnitudes is the scaled max."""
  pl, _ = _pallas()
  cols = t_ref.shape[1]
  maxima = [None, None]
  for start in range(0, t_ref.shape[0], tile_rows):
    v = t_ref[pl.ds(start, tile_rows), :].astype(jnp.float32)
    parts = _split_last(v.T)
    for c, ps in enumerate((parts, _transform_parts(parts, NV_BLOCK,
                                                    norm=False))):
      m = functools.reduce(jnp.maximum, (_fp32_bits(p) for p in ps))
      maxima[c] = m if maxima[c] is None else jnp.maximum(maxima[c], m)
  factor = hadamard_lib._norm(NV_BLOCK)  # noqa: SLF001
  for out, m, scaled in ((a_ref, maxima[0], False), (at_ref, maxima[1], True)):
    m = jnp.max(m.reshape(cols // NV_BLOCK, NV_BLOCK), axis=1)
    if scaled:
      m = _fp32_bits(jax.lax.bitcast_convert_type(m, jnp.float32) * factor)
    out[...] = m.reshape(1, cols // NV_BLOCK)


def nvfp4_tile_rows(rows: int) -> int:
  """Rows of `nvfp4_amaxes`' tiles, whose maxima a reduction of one kernel
  then combines (a finer grid of maxima, XLA reduces in two): 16 times the
  largest power of two up to 16 that divides ``rows / 16``.

  Example:
    >>> nvfp4_tile_rows(4096), nvfp4_tile_rows(48)
    (256, 16)
  """
  return NV_BLOCK * math.gcd(rows // NV_BLOCK, NV_BLOCK)


@functools.partial(jax.jit, static_argnames=("interpret",))
def nvfp4_amaxes(t: jax.Array, *, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """The amaxes of ``t (R, C)`` and of its 16-point
  `qlayers.hadamard.transform` along the rows (FP32; +Inf where either
  holds Inf or NaN, as `qlayers.blocks.amax`), in one pass: the two
  tensor amaxes `nvfp4_cast_transpose` scales NVFP4's Wgrad-transformed
  pair by. XLA would write the transform's stages before reducing them.

  Example:
    >>> import jax.numpy as jnp
    >>> a, at = nvfp4_amaxes(jnp.ones((16, 16)).at[3, 5].set(-8.0),
    ...                      interpret=True)
    >>> float(a), float(at)
    (8.0, 3.25)
  """
  if not nvfp4_supported(t.shape):
    raise ValueError(f"nvfp4_amaxes takes a 2-D tensor whose dims are "
                     f"multiples of {NV_BLOCK}; got {t.shape}.")
  rt, b = nvfp4_tile_rows(t.shape[0]), NV_BLOCK
  a, at = partition.cast(_nvfp4_amax_call, (rt, interpret), t,
                         layouts=((("r", rt), ("c", b)),) * 2,
                         block=(rt, b))
  return tuple(blocks._max_of_bits(x, jnp.float32)  # noqa: SLF001
               for x in (a, at))


def _nvfp4_amax_call(shape: tuple[int, int], rt: int, interpret: bool):
  """`nvfp4_amaxes`' kernel for a ``shape`` tensor, ``rt`` rows to a
  program: the two grids of magnitude-bit maxima per ``rt`` x 16."""
  pl, plt = _pallas()
  rows, cols = shape
  tc = 32 if cols % 32 == 0 else NV_BLOCK
  b = NV_BLOCK
  out = pl.BlockSpec((1, tc // b), lambda i, j: (i, j))
  partial = jax.ShapeDtypeStruct((rows // rt, cols // b), jnp.uint32)
  return pl.pallas_call(
      functools.partial(_nvfp4_amax_kernel,
                        tile_rows=32 if rt % 32 == 0 else NV_BLOCK),
      grid=(rows // rt, cols // tc),
      in_specs=[pl.BlockSpec((rt, tc), lambda i, j: (i, j))],
      out_specs=[out, out], out_shape=[partial, partial],
      compiler_params=plt.CompilerParams(num_warps=1),
      interpret=interpret, name="qlayers_nvfp4_amaxes")


def transform_supported(shape: tuple[int, ...], size: int, axis: int
                        ) -> bool:
  """Whether `transform` takes a ``shape`` tensor: 2-D, the transformed
  axis a multiple of ``size`` (one of `qlayers.hadamard.SIZES`), the other
  (axis 0) a multiple of 16."""
  return (len(shape) == 2 and axis in (0, 1) and size in hadamard_lib.SIZES
          and shape[axis] % size == 0
          and (axis == 1 or shape[1] % NV_BLOCK == 0))


def _transform_kernel(t_ref, o_ref, *, axis: int):
  v = t_ref[...].astype(jnp.float32)
  if axis == 1:
    o_ref[...] = _transform_last(v)
  else:  # [g, k, c]: the transformed axis made the last one and back
    o_ref[...] = jnp.transpose(
        _transform_last(jnp.transpose(v, (0, 2, 1))), (0, 2, 1))


@functools.partial(jax.jit, static_argnames=("size", "axis", "interpret"))
def transform(t: jax.Array, size: int, axis: int = 0, *,
              interpret: bool = False) -> jax.Array:
  """`qlayers.hadamard.transform` of ``t`` in one pass, bit for bit: FP32
  ``Q t`` along ``axis``. XLA writes each stage of the butterfly to memory
  (it will not fuse one into the next: every output would recompute its
  whole tree), so on NVIDIA GPUs the transformed operand of a recipe's
  Hadamard GEMMs is this kernel's, read once and written once.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import hadamard
    >>> t = jnp.arange(64.0 * 32).reshape(64, 32)
    >>> bool((transform(t, 32, interpret=True)
    ...       == hadamard.transform(t, 32)).all())
    True
  """
  if not transform_supported(t.shape, size, axis):
    raise ValueError(f"transform takes a 2-D tensor whose axis {axis} is a "
                     f"multiple of {size} (a size of "
                     f"{hadamard_lib.SIZES}) and, for axis 0, whose columns "
                     f"are a multiple of {NV_BLOCK}; got {t.shape}.")
  # Each device transforms its shard: whole blocks of ``size`` along the
  # axis, whole tiles of 16 across it for axis 0.
  block = (size, NV_BLOCK) if axis == 0 else (1, size)
  return partition.cast(_transform_call, (size, axis, interpret), t,
                        layouts=(partition.LIKE_T,), block=block)[0]


def _transform_call(shape: tuple[int, int], size: int, axis: int,
                    interpret: bool):
  """`transform`'s kernel for a ``shape`` tensor."""
  pl, plt = _pallas()
  rows, cols = shape
  if axis == 1:
    rt = math.gcd(rows, max(1, 1024 // size))
    spec = pl.BlockSpec((rt, size), lambda i, j: (i, j))
    grid = (rows // rt, cols // size)
    view = lambda t: t  # noqa: E731
    view_shape = shape
  else:
    n = math.gcd(rows // size, max(1, 256 // size))
    spec = pl.BlockSpec((n, size, NV_BLOCK), lambda i, j: (i, 0, j))
    grid = (rows // (n * size), cols // NV_BLOCK)
    view = lambda t: t.reshape(rows // size, size, cols)  # noqa: E731
    view_shape = (rows // size, size, cols)
  call = pl.pallas_call(
      functools.partial(_transform_kernel, axis=axis), grid=grid,
      in_specs=[spec], out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(view_shape, jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=4),
      interpret=interpret, name="qlayers_hadamard_transform")
  return lambda t: (call(view(t)).reshape(rows, cols),)
