"""Element formats: bit layouts, saturating casts, rounding and sub-byte packing.

Every format here is a small floating-point code: FP8 (E4M3, E5M2 and the
FNUZ variants used on MI300), the OCP MX element formats FP6 (E3M2, E2M3) and
FP4 (E2M1), and the E8M0 power-of-two scale. `ml_dtypes` is the reference for
every encoding; the tests check each code against it.

Casts saturate: values are clipped to +-max before they are converted, because
XLA and ml_dtypes give NaN (E4M3) or Inf (E5M2) on overflow. Rounding is
round-to-nearest-even, or stochastic with an explicit PRNG key.

Formats without a JAX dtype (FP6, and FP4 where a platform cannot compute on
it) travel as uint8 codes, packed: E2M1 two per byte (element 2i in the low
nibble), E3M2/E2M3 four per three bytes (24-bit little-endian word
``v0 | v1 << 6 | v2 << 12 | v3 << 18``), always along the last axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qlayers import threefry

__all__ = [
    "Format",
    "E4M3",
    "E5M2",
    "E4M3FNUZ",
    "E5M2FNUZ",
    "E3M2",
    "E2M3",
    "E2M1",
    "E8M0",
    "get_format",
    "FORMATS",
    "saturate",
    "round_to_format",
    "round_on_grid",
    "grid_codes",
    "cast",
    "encode",
    "decode",
    "pack",
    "unpack",
    "packed_size",
    "rounding_key",
]


@dataclasses.dataclass(frozen=True)
class Format:
  """A floating-point element format.

  Attributes:
    name: short name (``"e4m3"``, ``"e2m1"``, ...).
    ebits: exponent bits.
    mbits: explicit mantissa bits.
    bias: exponent bias.
    max: largest finite value.
    emax: exponent of ``max`` (``floor(log2(max))``), the OCP ``emax_elem``.
    min_normal: smallest positive normal value.
    min_subnormal: smallest positive value (subnormal; equals ``min_normal``
      for formats without subnormals).
    dtype: the JAX dtype holding it, or ``None`` when it only travels as codes.
    np_dtype: the ml_dtypes reference type.
    has_nan: whether any code is NaN.
    signed: whether there is a sign bit (E8M0 has none).
  """

  name: str
  ebits: int
  mbits: int
  bias: int
  max: float
  min_normal: float
  min_subnormal: float
  dtype: object
  np_dtype: object
  has_nan: bool
  signed: bool = True

  @property
  def bits(self) -> int:
    return int(self.signed) + self.ebits + self.mbits

  @property
  def emax(self) -> int:
    return int(np.floor(np.log2(self.max)))

  @property
  def emin(self) -> int:
    """Exponent of the smallest normal value."""
    return int(np.log2(self.min_normal))

  @property
  def packed(self) -> bool:
    """True when payloads of this format are stored as packed uint8 codes."""
    return self.bits < 8

  def __repr__(self) -> str:
    return f"Format({self.name})"


def _info(np_dtype):
  fi = ml_dtypes.finfo(np_dtype)
  return dict(
      max=float(fi.max),
      min_normal=float(fi.smallest_normal),
      min_subnormal=float(fi.smallest_subnormal),
  )


# Bit layouts and biases: OCP 8-bit floating point spec (E4M3/E5M2), OCP MX
# v1.0 section 5.3 (E3M2, E2M3, E2M1, E8M0); FNUZ variants as in ml_dtypes.
E4M3 = Format("e4m3", 4, 3, 7, dtype=jnp.float8_e4m3fn,
              np_dtype=ml_dtypes.float8_e4m3fn, has_nan=True,
              **_info(ml_dtypes.float8_e4m3fn))
E5M2 = Format("e5m2", 5, 2, 15, dtype=jnp.float8_e5m2,
              np_dtype=ml_dtypes.float8_e5m2, has_nan=True,
              **_info(ml_dtypes.float8_e5m2))
E4M3FNUZ = Format("e4m3fnuz", 4, 3, 8, dtype=jnp.float8_e4m3fnuz,
                  np_dtype=ml_dtypes.float8_e4m3fnuz, has_nan=True,
                  **_info(ml_dtypes.float8_e4m3fnuz))
E5M2FNUZ = Format("e5m2fnuz", 5, 2, 16, dtype=jnp.float8_e5m2fnuz,
                  np_dtype=ml_dtypes.float8_e5m2fnuz, has_nan=True,
                  **_info(ml_dtypes.float8_e5m2fnuz))
E3M2 = Format("e3m2", 3, 2, 3, dtype=None, np_dtype=ml_dtypes.float6_e3m2fn,
              has_nan=False, **_info(ml_dtypes.float6_e3m2fn))
E2M3 = Format("e2m3", 2, 3, 1, dtype=None, np_dtype=ml_dtypes.float6_e2m3fn,
              has_nan=False, **_info(ml_dtypes.float6_e2m3fn))
E2M1 = Format("e2m1", 2, 1, 1, dtype=None, np_dtype=ml_dtypes.float4_e2m1fn,
              has_nan=False, **_info(ml_dtypes.float4_e2m1fn))
# E8M0: unsigned, exponent only, 2**(code - 127); 0xFF is NaN; no zero.
E8M0 = Format("e8m0", 8, 0, 127, max=2.0**127, min_normal=2.0**-127,
              min_subnormal=2.0**-127, dtype=jnp.float8_e8m0fnu,
              np_dtype=ml_dtypes.float8_e8m0fnu, has_nan=True, signed=False)

FORMATS = {f.name: f for f in
           (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ, E3M2, E2M3, E2M1, E8M0)}
_ALIASES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2",
            "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2",
            "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz",
            "fp6_e3m2": "e3m2", "fp6_e2m3": "e2m3", "fp4": "e2m1",
            "fp4_e2m1": "e2m1", "float4_e2m1fn": "e2m1"}


def get_format(fmt: Format | str) -> Format:
  """Returns the `Format` named ``fmt`` (or ``fmt`` itself).

  Example:
    >>> get_format("fp8_e4m3").max, get_format("fp4").bits
    (448.0, 4)
  """
  if isinstance(fmt, Format):
    return fmt
  key = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
  if key not in FORMATS:
    raise ValueError(
        f"Unknown element format {fmt!r}; known: {sorted(FORMATS)}.")
  return FORMATS[key]


def saturate(x: jax.Array, fmt: Format | str) -> jax.Array:
  """Clips ``x`` to ``[-max, max]`` of ``fmt``; NaN stays NaN, +-Inf saturate.

  Example:
    >>> saturate(jnp.array([500.0, -jnp.inf, 1.0]), "e4m3")
    Array([ 448., -448.,    1.], dtype=float32)
  """
  fmt = get_format(fmt)
  # Python bounds (weakly typed: x's dtype): no negated array constant, which
  # a Pallas kernel cannot lower.
  return jnp.clip(x, -fmt.max, fmt.max)


def _f32_exponent(x: jax.Array) -> jax.Array:
  """floor(log2 |x|) of float32 ``x`` from its bits (-127 for 0/subnormal)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def _pow2(e: jax.Array) -> jax.Array:
  """2**e as float32 for integer e in the normal range, from bits."""
  return jax.lax.bitcast_convert_type(
      ((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _ulp(x: jax.Array, fmt: Format) -> jax.Array:
  """Grid spacing of ``fmt`` at each |x| (subnormal spacing below min normal)."""
  # Bit arithmetic, not frexp/ldexp: XLA lowers those to pow on CPU.
  e = jnp.maximum(_f32_exponent(x), fmt.emin)
  return _pow2(e - fmt.mbits)


def round_to_format(x: jax.Array, fmt: Format | str, *,
                    key: jax.Array | None = None) -> jax.Array:
  """Rounds ``x`` (float32) onto the value grid of ``fmt``, saturating.

  Round-to-nearest-even without ``key``; with ``key``, stochastic rounding:
  each magnitude rounds up with probability equal to its distance from the
  grid point below, divided by the spacing, to 8 bits (`qlayers.threefry`:
  within 1/512 of it, and unbiased on average over the values between two
  grid points). The result is float32 holding exactly representable values,
  so a later ``astype`` to the format's dtype (or `encode`) is exact.

  Example:
    >>> round_to_format(jnp.array([0.25, 0.75, 2.6, 9.0]), "e2m1")
    Array([0., 1., 3., 6.], dtype=float32)
  """
  fmt = _element_format(get_format(fmt), "round_to_format")
  r = None if key is None else threefry.random_bytes(key, x.shape)
  return round_on_grid(x, fmt, r)


def _element_format(fmt: Format, where: str) -> Format:
  """``fmt``, unless it is E8M0: unsigned, no zero, a scale's format."""
  if fmt is E8M0:
    raise ValueError(f"E8M0 holds scales: use scaling.mx_scale_codes, not "
                     f"{where}().")
  return fmt


def _unsigned_zero(sign: jax.Array, magnitude_is_zero: jax.Array,
                   fmt: Format) -> jax.Array:
  """``sign`` cleared where the magnitude is 0 for FNUZ formats, which have
  no -0 (their code 0x80 is NaN); ``sign`` as it is for the others."""
  if fmt not in (E4M3FNUZ, E5M2FNUZ):
    return sign
  return jnp.where(magnitude_is_zero, jnp.zeros_like(sign), sign)


def _grid_steps(x: jax.Array, fmt: Format, r: jax.Array | None,
                truncate=None, binades: bool = False):
  """``x`` saturated and rounded as ``sign * k * 2**(e - mbits)``: its sign
  bit (uint32, in place), the number of grid steps ``k`` (uint32) and the
  exponent ``e`` (int32).

  ``fmt``'s spacing at ``|x|`` is ``2**(e - mbits)``, ``e = max(exponent of
  x, emin)``, so ``|x|`` is ``y = |x| * 2**(mbits - e)`` steps, exactly (a
  power-of-two product), and ``y < 2**(mbits + 1)``. To nearest even:
  FP32 addition's own rounding, ``y + 2**23`` (its bits less those of
  ``2**23`` are the integer). Up with probability ``frac(y)``, given a
  random byte ``b``: ``floor(y + (2b + 1) / 512)``, exactly ``(floor(512
  y) + 2b + 1) >> 9``. Mostly FP32 arithmetic, so a GPU kernel spends
  few of its integer instructions on it. ``truncate``: the conversion of
  ``512 y`` to uint32 (None: ``astype``, which saturates). ``binades``:
  ``k`` counts on from the format's lowest binade, ``k + (e - emin) *
  2**mbits``, its code's magnitude; stochastic rounding adds it before
  its shift (``(e - emin) * 2**(mbits + 9)``), which a kernel then does
  in the rounding's additions."""
  x = x.astype(jnp.float32)
  sign = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x80000000)
  a = jnp.minimum(jnp.abs(x), fmt.max)  # saturated; NaN stays NaN
  # a's sign bit is clear, so its bits above the mantissa are the exponent
  # alone (`_f32_exponent` without its mask: an instruction per element
  # fewer in a kernel).
  e = jnp.maximum((jax.lax.bitcast_convert_type(a, jnp.uint32) >> 23
                   ).astype(jnp.int32) - 127, fmt.emin)
  if r is None:
    y = a * _pow2(fmt.mbits - e)
    k = jax.lax.bitcast_convert_type(y + 2.0**23, jnp.uint32) - jnp.uint32(
        0x4B000000)
    if binades:
      k = k + ((e - fmt.emin).astype(jnp.uint32) << fmt.mbits)
  else:  # 512 y, exact; its conversion truncates, the floor of y >= 0
    y512 = a * _pow2(fmt.mbits + 9 - e)
    k = ((y512.astype(jnp.uint32) if truncate is None else truncate(y512))
         + 2 * jnp.asarray(r, jnp.uint32) + 1)
    if binades:
      k = k + ((e - fmt.emin).astype(jnp.uint32) << (fmt.mbits + 9))
    k = k >> 9
  return sign, k, e


def round_on_grid(x: jax.Array, fmt: Format,
                  r: jax.Array | None = None) -> jax.Array:
  """`round_to_format` of ``x`` given its random bytes ``r`` (uint32 in
  [0, 256), `qlayers.threefry`; None: round to nearest even). Exact
  operations and one IEEE FP32 addition's rounding, so XLA and a GPU
  kernel get the same bits; NaN stays NaN.

  Example:
    >>> round_on_grid(jnp.array([0.75, -2.5, 5.0]), E2M1)
    Array([ 1., -2.,  4.], dtype=float32)
  """
  sign, k, e = _grid_steps(x, fmt, r)
  sign = _unsigned_zero(sign, k == 0, fmt)
  v = jax.lax.bitcast_convert_type(
      k.astype(jnp.float32) * _pow2(e - fmt.mbits), jnp.uint32) | sign
  return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(
      v, jnp.float32))


def grid_codes(x: jax.Array, fmt: Format,
               r: jax.Array | None = None, *, truncate=None,
               nan: bool = True) -> jax.Array:
  """``encode(round_on_grid(x, fmt, r), fmt)`` as uint32 codes, without the
  float round trip: a magnitude of ``k`` steps at exponent ``e`` is code
  ``k + (e - emin) * 2**mbits`` (a rounding up to the next binade carries
  into the exponent field). NaN gives its signed zero's code; ``nan=False``
  leaves that test out, for a caller whose ``x`` holds none (a GPU
  kernel's, `qlayers.cast_transpose`). ``truncate``: how stochastic
  rounding converts its FP32 steps to uint32 (`_grid_steps`).

  Example:
    >>> grid_codes(jnp.array([0.75, -2.5, 5.0]), E2M1)
    Array([ 2, 12,  6], dtype=uint32)
  """
  _element_format(fmt, "grid_codes")
  sign, k, _ = _grid_steps(x, fmt, r, truncate, binades=True)
  sign = _unsigned_zero(sign >> (32 - fmt.bits), k == 0, fmt)
  code = sign | k
  return jnp.where(jnp.isnan(x), sign, code) if nan else code


def rounding_key(seed: jax.Array, step: jax.Array) -> jax.Array:
  """The stochastic-rounding key of call ``step`` of a GEMM seeded ``seed``:
  the Threefry-2x32 key whose two words are ``(seed, step)``.

  Made of the two counters alone (never of the data); the bits drawn from
  it (`qlayers.threefry.random_bytes`) are a function of each element's
  place alone, so a sharded operand rounds as the same operand on one
  device does. Distinct ``(seed, step)`` pairs are distinct keys; Threefry
  hashes the key with each counter, so nothing is hashed here
  (`jax.random.key` takes a seed as key words the same way), and on a GPU
  no kernel runs to make it.

  Example:
    >>> k = rounding_key(jnp.uint32(3), jnp.uint32(5))
    >>> jax.random.key_data(k).tolist()
    [3, 5]
  """
  seed, step = jnp.asarray(seed), jnp.asarray(step)
  if not all(jnp.issubdtype(c.dtype, jnp.integer) for c in (seed, step)):
    raise TypeError(f"rounding_key takes integer counters, got seed "
                    f"{seed.dtype} and step {step.dtype}.")
  if seed.shape != step.shape:
    raise ValueError(f"rounding_key takes a seed and a step of one shape, "
                     f"got {seed.shape} and {step.shape}.")
  words = jnp.stack([seed.astype(jnp.uint32), step.astype(jnp.uint32)],
                    axis=-1)
  return jax.random.wrap_key_data(words, impl="threefry2x32")


def cast(x: jax.Array, fmt: Format | str, *,
         key: jax.Array | None = None) -> jax.Array:
  """Saturating cast of ``x`` to ``fmt``.

  Returns an array of the format's JAX dtype (FP8), or uint8 codes
  (unpacked, one per element) for FP6/FP4. Round-to-nearest-even unless a
  stochastic-rounding ``key`` is given. +-Inf saturates like any overflow;
  `qlayers.scaling.quantize` gives a unit holding Inf or NaN a NaN scale, so
  a non-finite operand still makes its GEMM non-finite.

  Example:
    >>> cast(jnp.array([1000.0, 0.3]), "e4m3")
    Array([448, 0.3125], dtype=float8_e4m3fn)
    >>> cast(jnp.array([-6.0, 0.5]), "e2m1")  # codes: sign | exp | mantissa
    Array([15,  1], dtype=uint8)
  """
  fmt = _element_format(get_format(fmt), "cast")
  if fmt.packed:
    r = None if key is None else threefry.random_bytes(key, x.shape)
    return grid_codes(x, fmt, r).astype(jnp.uint8)
  if key is None:
    # XLA's convert rounds to nearest even; saturating first avoids NaN/Inf.
    y = saturate(x, fmt)
  else:
    y = round_to_format(x, fmt, key=key)
  if fmt in (E4M3FNUZ, E5M2FNUZ):
    # FNUZ has no -0 (its code 0x80 is NaN): whatever rounds to zero comes
    # out +0, however a backend's convert treats the sign (XLA:CPU's older
    # fusion emitter, jaxlib < 0.11, keeps it). Half the smallest
    # subnormal is a tie, which rounds to even: 0.
    y = jnp.where(jnp.abs(y) <= fmt.min_subnormal / 2, 0.0, y)
  return y.astype(fmt.dtype)


def encode(values: jax.Array, fmt: Format | str) -> jax.Array:
  """Bit codes (uint8) of values already on ``fmt``'s grid (see `round_to_format`).

  FP8 and E8M0 codes are their dtype's (as ml_dtypes gives them: NaN to
  the format's NaN, E5M2's +-Inf to its Inf; an FNUZ zero is +0, its 0x80
  being NaN). FP6/FP4 have neither: NaN maps to code 0 (the MX scale
  carries it).

  Example:
    >>> encode(jnp.array([1.5, -28.0]), "e3m2")
    Array([14, 63], dtype=uint8)
    >>> encode(jnp.array([jnp.inf, jnp.nan]), "e5m2")
    Array([124, 126], dtype=uint8)
  """
  fmt = get_format(fmt)
  v = values.astype(jnp.float32)
  if fmt.dtype is not None:  # on the grid: the convert is exact
    if fmt in (E4M3FNUZ, E5M2FNUZ):  # what rounds to zero is +0 (as cast)
      v = jnp.where(jnp.abs(v) <= fmt.min_subnormal / 2, 0.0, v)
    return jax.lax.bitcast_convert_type(v.astype(fmt.dtype), jnp.uint8)
  sign = jnp.signbit(v).astype(jnp.uint32)
  mag = jnp.abs(jnp.where(jnp.isnan(v), 0.0, v))
  bits = jax.lax.bitcast_convert_type(mag, jnp.uint32)
  normal = mag >= fmt.min_normal
  # On the grid, a normal value's mantissa is the top `mbits` of float32's.
  exp_field = jnp.where(normal, ((bits >> 23) & 0xFF).astype(jnp.int32)
                        - 127 + fmt.bias, 0)
  mant = jnp.where(normal, (bits & 0x7FFFFF) >> (23 - fmt.mbits),
                   (mag * (1.0 / fmt.min_subnormal)).astype(jnp.uint32))
  code = ((sign << (fmt.bits - 1))
          | (exp_field.astype(jnp.uint32) << fmt.mbits)
          | mant)
  return code.astype(jnp.uint8)


def decode(codes: jax.Array, fmt: Format | str,
           dtype=jnp.float32) -> jax.Array:
  """Values of uint8 ``codes`` of ``fmt`` (one code per element, unpacked).

  Computed from the bit fields, without a lookup table: no array constant
  enters the traced program (a partitioned GEMM's local computation may
  hold none, see `qlayers.partition`).

  Example:
    >>> decode(jnp.array([14, 63], jnp.uint8), "e3m2")
    Array([  1.5, -28. ], dtype=float32)
  """
  fmt = get_format(fmt)
  if codes.dtype != jnp.uint8:
    raise TypeError(f"decode expects uint8 codes, got {codes.dtype}.")
  if fmt.dtype is not None:  # an FP8 type: the codes are its bits
    return jax.lax.bitcast_convert_type(codes, fmt.dtype).astype(dtype)
  # FP6/FP4 have no Inf/NaN codes (OCP MX v1.0 section 5.3): a normal code's
  # fields move into an FP32's, a subnormal is mantissa * smallest subnormal.
  c = codes.astype(jnp.uint32)
  negative = ((c >> (fmt.bits - 1)) & 1) == 1
  exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
  mant = c & ((1 << fmt.mbits) - 1)
  normal = jax.lax.bitcast_convert_type(
      ((exp_field + (127 - fmt.bias)) << 23) | (mant << (23 - fmt.mbits)),
      jnp.float32)
  mag = jnp.where(exp_field == 0, mant.astype(jnp.float32) * fmt.min_subnormal,
                  normal)
  return jnp.where(negative, -mag, mag).astype(dtype)


def _group(fmt: Format) -> tuple[int, int]:
  """(elements, bytes) of one packing group."""
  if fmt.bits == 4:
    return 2, 1
  if fmt.bits == 6:
    return 4, 3
  raise ValueError(f"{fmt.name} is not a packed format.")


def packed_size(n: int, fmt: Format | str) -> int:
  """Bytes holding ``n`` packed elements of ``fmt`` along the last axis.

  Example:
    >>> packed_size(64, "e2m1"), packed_size(64, "e3m2")
    (32, 48)
  """
  fmt = get_format(fmt)
  elems, nbytes = _group(fmt)
  if n % elems:
    raise ValueError(
        f"{fmt.name} packs {elems} values together; the last dimension "
        f"({n}) must be a multiple of {elems}.")
  return n // elems * nbytes


def pack(codes: jax.Array, fmt: Format | str) -> jax.Array:
  """Packs unpacked uint8 ``codes`` of a 4- or 6-bit format along the last axis
  (each below ``2**bits``: higher bits are dropped).

  Example:
    >>> pack(jnp.array([1, 15, 2, 3], jnp.uint8), "e2m1")  # low nibble first
    Array([241,  50], dtype=uint8)
  """
  fmt = get_format(fmt)
  elems, nbytes = _group(fmt)
  if codes.dtype != jnp.uint8:
    raise TypeError(f"pack expects uint8 codes (formats.cast gives them), "
                    f"got {codes.dtype}.")
  n = codes.shape[-1]
  packed_size(n, fmt)  # validates
  lead = codes.shape[:-1]
  # Each group of codes, bitcast to one wide word (little-endian: element i
  # in byte i), has its codes moved from 8-bit to `bits`-bit positions. Only
  # elementwise ops and bitcasts: no strided slices for XLA to refuse to fuse.
  wide = jnp.uint16 if elems == 2 else jnp.uint32
  word = _words(codes.astype(jnp.uint8).reshape(*lead, n // elems, elems),
                wide)
  mask = (1 << fmt.bits) - 1
  if elems == 2:
    # 4 bits: the low byte of the word, by a convert (a bitcast to bytes and
    # a slice would be a kernel of its own on GPUs).
    out = (word & mask) | ((word >> 4) & (mask << 4))
    return out.astype(jnp.uint8).reshape(*lead, n // 2)
  out = functools.reduce(jnp.bitwise_or, [
      ((word >> (8 * i)) & mask) << (fmt.bits * i) for i in range(elems)])
  out = _bytes(out)[..., :nbytes]
  return out.reshape(*lead, n // elems * nbytes)


def unpack(packed: jax.Array, fmt: Format | str) -> jax.Array:
  """Exact inverse of `pack`: uint8 bytes -> one uint8 code per element.

  Example:
    >>> unpack(jnp.array([241, 50], jnp.uint8), "e2m1")
    Array([ 1, 15,  2,  3], dtype=uint8)
  """
  fmt = get_format(fmt)
  elems, nbytes = _group(fmt)
  if packed.dtype != jnp.uint8:
    raise TypeError(f"unpack expects uint8, got {packed.dtype}.")
  nb = packed.shape[-1]
  if nb % nbytes:
    raise ValueError(
        f"Packed {fmt.name} rows hold groups of {nbytes} bytes; got {nb}.")
  lead = packed.shape[:-1]
  groups = packed.reshape(*lead, nb // nbytes, nbytes)
  wide = jnp.uint16 if elems == 2 else jnp.uint32
  # A group's little-endian word put together by shifts, its codes moved
  # from `bits`-bit to 8-bit positions, and the word seen as bytes: on GPUs
  # one fusion (a bitcast of the group's bytes to a word needed a padding
  # concatenate first, and made two).
  word = functools.reduce(jnp.bitwise_or, [
      groups[..., j].astype(wide) << (8 * j) for j in range(nbytes)])
  mask = (1 << fmt.bits) - 1
  spread = functools.reduce(jnp.bitwise_or, [
      ((word >> (fmt.bits * i)) & mask) << (8 * i) for i in range(elems)])
  return _bytes(spread).reshape(*lead, nb // nbytes * elems)


# A bitcast between bytes and wider words changes the rank, and StableHLO's
# shape refinement fails on one with a symbolic dim (a `jax.export`ed batch),
# so there the bytes are moved by shifts (the same values).
def _concrete(shape) -> bool:
  return all(isinstance(d, int) for d in shape)


def _words(groups: jax.Array, wide) -> jax.Array:
  """The little-endian ``wide`` words of the bytes on ``groups``' last
  axis."""
  if _concrete(groups.shape):
    return jax.lax.bitcast_convert_type(groups, wide)
  return functools.reduce(jnp.bitwise_or, [
      groups[..., i].astype(wide) << (8 * i)
      for i in range(groups.shape[-1])])


def _bytes(words: jax.Array) -> jax.Array:
  """The little-endian bytes of ``words`` on a new last axis."""
  if _concrete(words.shape):
    return jax.lax.bitcast_convert_type(words, jnp.uint8)
  return jnp.stack([((words >> (8 * i)) & 0xFF).astype(jnp.uint8)
                    for i in range(words.dtype.itemsize)], axis=-1)
