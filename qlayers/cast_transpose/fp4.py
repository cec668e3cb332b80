"""MXFP4's two copies of ``t (R, C)`` in one pass.

`fp4_cast_transpose` makes MXFP4's two copies, each packed two E2M1 codes
per byte along its own contraction axis, where XLA makes each in four
passes (block amax, scale, unpacked codes, packing). With stochastic
rounding each copy draws, in the kernel, the random bytes `qlayers.formats`
draws from its key (`qlayers.threefry`), so no random-bits array is
written or read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qlayers import formats
from qlayers import hadamard as hadamard_lib
from qlayers import partition
from qlayers import threefry
from qlayers.cast_transpose import _base
from qlayers.cast_transpose import _e2m1
from qlayers.cast_transpose import _lanes
from qlayers.cast_transpose.blockwise import MX_BLOCK
from qlayers.formats import Format

__all__ = ["fp4_supported", "fp4_transforms", "fp4_cast_transpose"]


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
  codes (`_e2m1.block_e2m1_words`, converted by PTX where ``hardware``)."""
  if stochastic:
    origin_ref, key_ref, t_ref, q_ref, s_ref, qt_ref, st_ref = refs
  else:
    t_ref, q_ref, s_ref, qt_ref, st_ref = refs
  pl, _ = _base.pallas()
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
    parts = _lanes.split_last(y)
    if hadamard[c]:
      parts = _lanes.transform_parts(parts, hadamard[c])
    mult, code = block_multiplier(parts, rule)
    u = None
    if stochastic:
      # Each copy draws the random bytes of its own places (`threefry`):
      # word w of a row is the hash at column w of its eighths, whose bytes
      # are its elements' (a row's counter product computed once).
      row, col, width = ((i + down, j >> 3, cols >> 3) if c == 0
                         else (j + down, i >> 3, rows >> 3))
      u = [byte for w in range(b // 8) for byte in threefry.eighths_at(
          key_ref[2 * c], key_ref[2 * c + 1], row, col + w, width,
          rotl=_base.rotl_wide if hardware else None)]
    write_blocks(parts, mult, code, q, sc, rule=rule, random=u,
                 hardware=hardware)


def block_multiplier(parts, rule: str):
  """(multiplier, E8M0 code as uint32) of a tile's rows held apart
  (``parts``: their 32 elements, one FP32 array each,
  `_lanes.split_last`), each row one MXFP4 block."""
  mag = functools.reduce(jnp.maximum,
                         (_base.doubled_bits(p) for p in parts)) >> 1
  return _base.pow2_multiplier(mag, formats.E2M1, rule)


def write_blocks(parts, mult, code, q, sc, *, rule: str, random=None,
                 hardware: bool = False):
  """Writes the MXFP4 copy of the rows ``parts`` (`block_multiplier`'s
  ``mult`` and ``code``) to ``q`` as words of eight codes, rounded to
  nearest or with the random bytes ``random`` (one array per element), and
  their scales to ``sc``."""
  q[...] = _lanes.join_last(_e2m1.block_e2m1_words(parts, mult, random,
                                                   hardware))
  sc[...] = _base.scales_out(code, rule)[:, None]


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
                  _base.ptx_converts(formats.E2M1, interpret), interpret),
      *args,
      layouts=((("r", 1), ("c", 8)), (("r", 1), ("c", b)),
               (("c", 1), ("r", 8)), (("c", 1), ("r", b))),
      block=(b, b), origin=keys is not None)
  return _lanes.words_to_bytes(q), s, _lanes.words_to_bytes(qt), st


def _fp4_call(shape: tuple[int, int], rule: str, stochastic: bool,
              hadamard: tuple[int, int], hardware: bool, interpret: bool):
  """`fp4_cast_transpose`'s kernel for a ``shape`` tensor: a function of
  (with ``stochastic``: the shard's origin in t and the keys' words,) the
  tensor."""
  pl, plt = _base.pallas()
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
