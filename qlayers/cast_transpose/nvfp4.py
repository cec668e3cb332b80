"""NVFP4's two copies of ``t (R, C)`` in one pass: E2M1 with E4M3 scales
per 16 under a per-tensor FP32 scale.

`nvfp4_cast_transpose` writes 1 x 16 tiles along each axis, the one along
the rows (Wgrad's) of the 16-point Hadamard transform if asked, or 16 x 16
blocks in both layouts (the weights). The per-tensor scales need the whole
tensor's amax first: `nvfp4_amaxes` finds those of the tensor and of its
transform in one read.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from qlayers import blocks
from qlayers import formats
from qlayers import hadamard as hadamard_lib
from qlayers import partition
from qlayers import scale_rules
from qlayers import threefry
from qlayers.cast_transpose import _base
from qlayers.cast_transpose import _e2m1
from qlayers.cast_transpose import _lanes

__all__ = ["NV_BLOCK", "nvfp4_supported", "nvfp4_cast_transpose",
           "nvfp4_amaxes", "nvfp4_tile_rows"]


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
  s = jnp.minimum(_base.divide(scale_rules.NVFP4_RANGE, amax, interpret),
                  scale_rules.F32_MAX)
  s_enc = jnp.where((amax == 0) | (s == 0), 1.0, s)
  return s_enc, _base.divide(1.0, s_enc, interpret), jnp.isfinite(amax)


def _nvfp4_blocks(mag_max, levels, interpret: bool):
  """(multiplier, E4M3 scale as FP32) of blocks whose largest magnitude
  bits are ``mag_max``: `qlayers.scale_rules.nvfp4_scales`, in a
  kernel."""
  s_enc, s_dec, finite_tensor = levels
  amax = blocks.amax_from_bits(mag_max, jnp.float32)
  block = amax * (s_enc * scale_rules.F32_SIXTH)
  e4m3 = _base.saturating_cast(block, formats.E4M3, interpret).astype(
      jnp.float32)
  mult = jnp.minimum(_base.divide(1.0, e4m3 * s_dec, interpret),
                     scale_rules.F32_MAX)
  finite = jnp.isfinite(amax) & finite_tensor
  return jnp.where(finite, mult, 0.0), jnp.where(finite, e4m3, jnp.nan)


def _nvfp4_kernel(*refs, square: bool, hadamard: bool, stochastic: bool,
                  interpret: bool, hardware: bool = False):
  """One tile ``v`` (rows and columns each 16 or 32; one warp): the copy of
  ``v`` along its rows and that of ``v.T`` (of its 16-point transform along
  ``t``'s rows if ``hadamard``), each row's elements apart
  (`_lanes.split_last`), so a block's amax, transform, scale and words run in
  registers; eight E2M1 codes to a word (`_e2m1.e2m1_word`), as the MXFP4
  kernel does. With ``square``, 16 x 16 blocks: a block's amax is then
  over its 16 lanes too, one scale per block (one tensor amax)."""
  if stochastic:
    origin_ref, key_ref, *refs = refs
  amaxes, (t_ref, q_ref, s_ref, qt_ref, st_ref) = refs[:-5], refs[-5:]
  levels = [_encode_scales(jnp.reshape(a[...], (1,)), interpret)
            for a in amaxes]  # the copies' (square: one for both)
  pl, _ = _base.pallas()
  v = t_ref[...].astype(jnp.float32)
  if stochastic:  # this tile's place in t: its shard's (`origin`) and in it
    rows, cols = origin_ref[2], origin_ref[3]
    i, j = (origin_ref[a] + pl.program_id(a).astype(jnp.uint32) * v.shape[a]
            for a in (0, 1))
  for c, (y, q, sc) in enumerate(((v, q_ref, s_ref), (v.T, qt_ref, st_ref))):
    parts, lanes = _lanes.split_last(y), y.shape[0]
    if c and hadamard:
      parts = _lanes.transform_parts(parts, NV_BLOCK)
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
                               rotl=_base.rotl_wide if hardware else None)]
    write_blocks(parts, q, sc, levels[c % len(levels)], square=square,
                 random=u, interpret=interpret, hardware=hardware)


def write_blocks(parts, q, sc, levels, *, square: bool, random=None,
                 interpret: bool = False, hardware: bool = False):
  """Writes the NVFP4 copy of a tile's rows held apart (``parts``: their
  elements, one FP32 array each, `_lanes.split_last`) under the tensor's
  ``levels`` (`_encode_scales`) to ``q`` as words of eight E2M1 codes,
  rounded to nearest or with the random bytes ``random`` (one array per
  element), and their E4M3 block scales to ``sc``: per 1 x 16 block, or
  with ``square`` per 16 x 16 (a block's amax then over its 16 lanes too,
  one scale per block)."""
  lanes = parts[0].shape[0]
  words, scales = [], []
  for k in range(0, len(parts), NV_BLOCK):
    block = parts[k:k + NV_BLOCK]
    mag = functools.reduce(jnp.maximum, (_base.fp32_bits(p) for p in block))
    mult, e4m3 = _nvfp4_blocks(
        _lanes.lane_groups_max(mag, NV_BLOCK) if square else mag, levels,
        interpret)
    words += _e2m1.block_e2m1_words(block, mult,
                                    random and random[k:k + NV_BLOCK],
                                    hardware)
    # A 16 x 16 block's lanes hold its one scale.
    scales.append(jnp.max(e4m3.reshape(lanes // NV_BLOCK, NV_BLOCK),
                          axis=1) if square else e4m3)
  q[...] = _lanes.join_last(words)
  sc[...] = _lanes.join_last(scales).astype(jnp.float8_e4m3fn)


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
                    _base.ptx_converts(formats.E2M1, interpret), interpret),
      *args, t,
      layouts=((("r", 1), ("c", 8)), scales[0], (("c", 1), ("r", 8)),
               scales[1]),
      block=(b, b), origin=keys is not None)
  return _lanes.words_to_bytes(q), s, _lanes.words_to_bytes(qt), st


def _nvfp4_call(shape: tuple[int, int], square: bool, hadamard: bool,
                stochastic: bool, hardware: bool, interpret: bool):
  """`nvfp4_cast_transpose`'s kernel for a ``shape`` tensor: a function of
  (with ``stochastic``: the shard's origin in t and the keys' words,) the
  amaxes and the tensor, returning its four 2-D results."""
  pl, plt = _base.pallas()
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
  rows apart (`_lanes.split_last`), so the 16-point transform along the rows
  runs in registers: the magnitude-bit maxima of each 16 columns, of ``t``
  and of its transform. The transform's factor, a power of two, scales
  the maxima rather than each element: a product rounds monotonically, so
  the max of the scaled magnitudes is the scaled max."""
  pl, _ = _base.pallas()
  cols = t_ref.shape[1]
  maxima = [None, None]
  for start in range(0, t_ref.shape[0], tile_rows):
    v = t_ref[pl.ds(start, tile_rows), :].astype(jnp.float32)
    parts = _lanes.split_last(v.T)
    for c, ps in enumerate((parts, _lanes.transform_parts(parts, NV_BLOCK,
                                                    norm=False))):
      m = functools.reduce(jnp.maximum, (_base.fp32_bits(p) for p in ps))
      maxima[c] = m if maxima[c] is None else jnp.maximum(maxima[c], m)
  factor = hadamard_lib.norm(NV_BLOCK)
  for out, m, scaled in ((a_ref, maxima[0], False), (at_ref, maxima[1], True)):
    m = jnp.max(m.reshape(cols // NV_BLOCK, NV_BLOCK), axis=1)
    if scaled:
      m = _base.fp32_bits(jax.lax.bitcast_convert_type(m, jnp.float32) * factor)
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
  return tuple(blocks.max_of_bits(x, jnp.float32)
               for x in (a, at))


def _nvfp4_amax_call(shape: tuple[int, int], rt: int, interpret: bool):
  """`nvfp4_amaxes`' kernel for a ``shape`` tensor, ``rt`` rows to a
  program: the two grids of magnitude-bit maxima per ``rt`` x 16."""
  pl, plt = _base.pallas()
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
