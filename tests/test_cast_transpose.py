"""The one-pass FP8 cast-transpose (qlayers/cast_transpose.py) and the
operand pairs built on it (qlayers/operands.py: operand_pair)."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
import qlayers.scaling
from qlayers import cast_transpose as ct
from qlayers.cast_transpose import _base
from qlayers.cast_transpose import _e2m1
from qlayers.cast_transpose import _lanes
from qlayers.cast_transpose import fp8
from qlayers import formats
from qlayers import hadamard
from qlayers import ops
from qlayers import table
from qlayers import threefry
from qlayers.dispatch import Operand
from qlayers.operands import operand, operand_pair


def _bits(a):
  """Bit patterns, every NaN as one (E5M2 has several NaN codes; an Inf
  times zero is -NaN on x86 and +NaN on GPUs)."""
  a = np.asarray(a)
  u = a.view(np.dtype(f"u{a.dtype.itemsize}"))
  return np.where(np.isnan(a.astype(np.float32)), np.iinfo(u.dtype).max, u)


# Jitted: one compile per shape, where eager calls compile each of the
# butterfly's stages (a few ops each) one by one.
_transform = jax.jit(hadamard.transform, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(0, 1))  # one compile, not seven
def _data(shape, dtype):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 300.0
  # NaN, +-Inf, overflow past the format's max, values rounding to zero and
  # to subnormals, ties of the multiplier.
  x = x.at[0, 0].set(jnp.nan).at[1, 3].set(jnp.inf).at[2, 5].set(-jnp.inf)
  x = x.at[3, 7].set(-1e30).at[4, 9].set(1e-12).at[5, 11].set(3e-4)
  return x.astype(dtype)


# Amaxes: the data's, one whose multiplier is not a power of two (rounding
# exercised), the format's max times powers of two and the next FP32 above,
# zero, subnormal and tiny (the multiplier overflows to FLT_MAX), Inf, NaN.
_AMAXES = [None, 327.0, 448.0 * 2.0**-20, float(np.nextafter(
    np.float32(448.0 * 8), np.float32(np.inf))), 0.0, 1e-40, 1e-37,
           np.inf, np.nan]


# Every pair of values of any two of format, input dtype and (margin, pow2)
# (each its own part of the kernel: the cast, the load, the multiplier) in
# 6 cases, not all 12 combinations: each case compiles the kernel anew.
@pytest.mark.parametrize("fmt, dtype, margin, pow2", [
    ("e4m3", jnp.bfloat16, 0, False), ("e5m2", jnp.float32, 0, False),
    ("e4m3", jnp.float32, 2, False), ("e5m2", jnp.bfloat16, 2, False),
    ("e4m3", jnp.float32, 1, True), ("e5m2", jnp.bfloat16, 1, True)])
def test_both_layouts_and_the_scale_are_unit_scales_bit_for_bit(
    fmt, dtype, margin, pow2):
  special = _data((128, 192), dtype)
  finite = special.at[:3, :6].set(-5e3).at[3, 7].set(1.0)  # amax 5e3
  spec = qlayers.scaling.QuantSpec(format=fmt, margin=margin, pow2=pow2)
  for t, amax in [(finite, None)] + [(special, a) for a in _AMAXES]:
    a = (qlayers.scaling.amax(t) if amax is None else jnp.float32(amax))
    q, qt, scale = ct.cast_transpose(
        t, fmt, amax=None if amax is None else a, margin=margin, pow2=pow2,
        interpret=True)
    mult, want_scale = qlayers.scale_rules.unit_scales(a, spec)
    want = formats.cast(t.astype(jnp.float32) * mult, fmt)
    assert q.dtype == qt.dtype == want.dtype, amax
    np.testing.assert_array_equal(_bits(q), _bits(want), str(amax))
    np.testing.assert_array_equal(_bits(qt), _bits(want).T, str(amax))
    assert scale.dtype == jnp.float32 and scale.shape == ()
    np.testing.assert_array_equal(np.float32(scale).view(np.uint32),
                                  np.float32(want_scale).view(np.uint32),
                                  str(amax))
    if t is special:  # NaN is not saturated
      assert np.isnan(np.asarray(q[0, 0], np.float32))


# Delayed-scaling states (history, running amax before the use) against
# data of amax 5e3: the first step (empty history; the running amax below
# and above the data's), a history whose max is not its latest entry, a
# history of one entry (an algorithm's amax computed outside), a history
# of zeros but for the oldest entry.
_STATES = [(np.zeros(16), 0.0), (np.zeros(16), 7e3),
           (np.zeros(16), 3e2),
           ([0.0, 0.0, 0.0, 896.0] + [2.0] * 12, 1e9),
           ([327.0], 0.0), ([0.0] * 7 + [1.5], 2.0)]


# Each format and each (margin, pow2) once (their cross product is
# test_both_layouts_and_the_scale_are_unit_scales_bit_for_bit's).
@pytest.mark.parametrize("fmt, margin, pow2", [("e4m3", 0, False),
                                               ("e5m2", 1, True)])
def test_delayed_scale_is_delayed_amax_bit_for_bit(fmt, margin, pow2):
  """With a delayed role's state the kernel scales by `delayed_amax`'s amax
  of that state and the data's own amax, and writes its new running amax,
  whether it finds the data's amax itself as it casts (and on the first
  step in a kernel of its own) or takes the magnitude bits' max; Inf/NaN
  data get a NaN scale and leave the running amax as it was. Their payload
  is then all NaN (scaled by Inf), or, where the kernel found the amax and
  a stored history decides, the data cast by that history's amax."""
  finite = _data((128, 192), jnp.bfloat16).at[:3, :6].set(-5e3)
  finite = finite.at[0, 0].set(1.0).at[1, 3].set(2.0).at[2, 5].set(3.0)
  special = _data((128, 192), jnp.bfloat16)
  spec = qlayers.scaling.QuantSpec(format=fmt, margin=margin, pow2=pow2)
  bits = qlayers.blocks.magnitude_bits
  for t in (finite, special):
    for history, running in _STATES:
      history = jnp.asarray(history, jnp.float32)
      state = qlayers.scaling.ScaleState(history, jnp.float32(running))
      use, want_running = qlayers.scaling.delayed_amax(
          state, qlayers.scaling.amax(t))
      for amax in (None, jnp.max(bits(t))):
        if amax is None and t is special and jnp.max(history) > 0:
          stored = qlayers.scaling.history_amax(history, "max")
          mult, _ = qlayers.scale_rules.unit_scales(stored, spec)
          want_scale = jnp.float32(jnp.nan)
        else:
          mult, want_scale = qlayers.scale_rules.unit_scales(use, spec)
        want = _bits(formats.cast(t.astype(jnp.float32) * mult, fmt))
        q, qt, scale, new_running = ct.cast_transpose(
            t, fmt, amax=amax, delayed=(history, jnp.float32(running)),
            margin=margin, pow2=pow2, interpret=True)
        what = f"{history[:4]} {running} {amax is None} {t is special}"
        np.testing.assert_array_equal(
            np.float32(new_running).view(np.uint32),
            np.float32(want_running).view(np.uint32), what)
        np.testing.assert_array_equal(_bits(q), want, what)
        np.testing.assert_array_equal(_bits(qt), want.T, what)
        np.testing.assert_array_equal(_bits(np.float32(scale)),
                                      _bits(np.float32(want_scale)), what)
  with pytest.raises(ValueError, match="power of two"):
    ct.cast_transpose(finite, fmt, delayed=(jnp.zeros(3), jnp.float32(0)),
                      interpret=True)


def test_the_first_step_kernel_reads_the_tensor_only_without_a_history():
  """A delayed role's amax before the cast (`_first_amax_kernel`): the max
  of the data's FP32 magnitude bits (NaN above Inf, as `blocks.amax` orders
  them) while the history is empty, and nothing once it holds an amax.
  Blocks of four tiles, and of one where the columns are not a multiple."""
  zero = jnp.zeros((1,), jnp.uint32)
  for shape in ((128, 1280), (64, 320)):
    special = _data(shape, jnp.float32)  # NaN, +-Inf among the values
    finite = special.at[:6, :12].set(1.0).at[-1, -1].set(-3e38)
    for t in (finite, special):
      top = int((np.asarray(t).view(np.uint32) & 0x7FFFFFFF).max())
      for history, want in ((jnp.zeros(8), top),
                            (jnp.zeros(8).at[5].set(1.0), 0)):
        got, = fp8._first_amax_call(shape, 8, True)(history, zero, t)  # noqa: SLF001
        assert int(got[0]) == want, (shape, t is special, want)
  assert fp8._first_block(1280) == fp8._first_block(4096) == 256  # noqa: SLF001
  assert fp8._first_block(320) == 64  # noqa: SLF001


def test_one_layout_is_the_first_of_the_two_bit_for_bit():
  """``transpose=False`` (Blackwell) writes the same copy and scale, and no
  transposed one, from the data's amax or a delayed role's state."""
  t = _data((128, 192), jnp.bfloat16)
  finite = t.at[0, 0].set(1.0).at[1, 3].set(2.0).at[2, 5].set(3.0)
  for data, delayed in [(finite, None), (t, None),
                        (finite, (jnp.asarray(_STATES[3][0], jnp.float32),
                                  jnp.float32(_STATES[3][1])))]:
    two = ct.cast_transpose(data, "e4m3", delayed=delayed, interpret=True)
    one = ct.cast_transpose(data, "e4m3", delayed=delayed,
                            transpose=False, interpret=True)
    assert one[1] is None and len(one) == len(two) == 3 + (delayed is not None)
    np.testing.assert_array_equal(_bits(one[0]), _bits(two[0]))
    for a, b in zip(one[2:], two[2:]):  # the scale (and running amax)
      np.testing.assert_array_equal(np.float32(a).view(np.uint32),
                                    np.float32(b).view(np.uint32))


def test_refuses_what_it_cannot_cast():
  assert ct.supported((64, 128), formats.get_format("e4m3"))
  assert not ct.supported((64, 100), formats.get_format("e4m3"))
  assert not ct.supported((64, 64, 64), formats.get_format("e4m3"))
  assert not ct.supported((64, 64), formats.get_format("e2m1"))
  with pytest.raises(ValueError, match="multiples of 64"):
    ct.cast_transpose(jnp.ones((64, 100)), "e4m3", interpret=True)
  fp8_block = qlayers.scaling.QuantSpec(format="e4m3", scale_rule="deepseek")
  with table.target_arch("sm_90"):  # the kernel computes TE's rule only
    assert not qlayers.operands.pairable(jnp.ones((64, 128)),
                                         Operand(fp8_block, 1))


def _spec(name="fp8_current"):
  return qlayers.recipe(name).fprop.lhs


def test_pair_on_cpu_is_the_one_copy():
  t = _data((2, 64, 128), jnp.bfloat16)
  last, first = operand_pair(t, Operand(_spec(), 1))
  assert last is first  # no GPU targeted: nothing changes
  mx = _spec("mxfp8")
  assert not qlayers.operands.pairable(t, Operand(mx, 1), Operand(mx, 0))


def test_pair_for_a_gpu_holds_the_same_values_and_lowers_to_the_kernel():
  t = _data((2, 64, 128), jnp.bfloat16)
  ref = operand(t, Operand(_spec(), 1))
  with table.target_arch("sm_90"):
    last, first = operand_pair(t, Operand(_spec(), 1))
    cuda = jax.jit(lambda t: operand_pair(t, Operand(_spec(), 1))).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  for q in (last, first):  # run on CPU: XLA's branch
    assert q.payload.shape == (128, 128)
    np.testing.assert_array_equal(_bits(q.payload), _bits(ref.payload))
    np.testing.assert_array_equal(q.scale, ref.scale)
  assert cuda.count("__gpu$xla.gpu.triton") == 1
  assert "qlayers_cast_transpose" in cuda
  with table.target_arch("sm_100"):  # Blackwell's FP8 GEMM takes any layout
    last, first = operand_pair(t, Operand(_spec(), 1))
    cuda = jax.jit(lambda t: operand_pair(t, Operand(_spec(), 1))).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  assert last is first  # one copy, the kernel's, in one layout
  np.testing.assert_array_equal(_bits(last.payload), _bits(ref.payload))
  assert cuda.count("__gpu$xla.gpu.triton") == 1
  assert "qlayers_cast" in cuda and "qlayers_cast_transpose" not in cuda


@pytest.mark.parametrize("shape", [(2, 64, 100), (2, 64, 128)])
def test_pair_keeps_operand_where_the_kernel_does_not_apply(shape):
  t = jnp.ones(shape, jnp.bfloat16)
  with table.target_arch("sm_90"):
    for spec in (_spec("mxfp8"), _spec("fp8_current")):
      last, first = operand_pair(t, Operand(spec, 1))
      one_copy = spec.granularity != "tensor" or shape[-1] % ct.TILE
      assert (last is first) == bool(one_copy)


# Each format and each rule once: the rule sets the scale, the format the
# cast, apart in the kernel.
@pytest.mark.parametrize("fmt, rule", [("e4m3", "mx_rceil"),
                                       ("e5m2", "mx_floor")])
def test_mx_copies_are_quantize_along_each_axis_bit_for_bit(fmt, rule):
  t = _data((96, 160), jnp.bfloat16).at[40, 70].set(1e-30)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx",
                                   scale_rule=rule)
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, rule, interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  np.testing.assert_array_equal(_bits(q), _bits(rows.payload))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(_bits(qt), _bits(cols.payload).T)
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert int(s[0, 0]) == 255  # the NaN's block


@pytest.mark.parametrize("fmt,margin,pow2,dtype", [
    ("e4m3", 0, True, jnp.bfloat16), ("e5m2", 2, False, jnp.float32)])
def test_row_copies_are_quantize_along_each_axis_bit_for_bit(fmt, margin,
                                                             pow2, dtype):
  """Row-wise copies: scaled per row and per column (transposed), with
  TE's rule, equal `scaling.quantize` along axis 1 and axis 0 bit for bit:
  a NaN and an Inf row and column, a zero row, a column of values that
  round to zero, overflow past the format's max."""
  t = _data((192, 256), dtype).at[70, :].set(0.0).at[:, 200].set(1e-38)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="row",
                                   margin=margin, pow2=pow2)
  q, s, qt, st = ct.row_cast_transpose(t, fmt, margin=margin, pow2=pow2,
                                       interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  for got, want in ((q, rows.payload), (qt, cols.payload.T)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert np.isnan(np.asarray(s[0, 0])) and float(s[70, 0]) == 1.0
  with pytest.raises(ValueError, match="multiples of"):
    ct.row_cast_transpose(t[:100], fmt, interpret=True)


def _paired_against_unpaired(monkeypatch, recipe, arch, kernel, record):
  """(unpaired, paired) value and gradients of a ``recipe`` matmul, the
  paired one traced for ``arch`` with every pair's CUDA branch taken and
  ``cast_transpose.<kernel>`` run in Pallas' interpreter on CPU;
  ``record(t, args, kw)`` sees each of its calls."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1

  def loss(x, w):
    y, _ = ops.quantized_matmul(x, w, recipe)
    return jnp.sum(y * jnp.cos(y))

  # Jitted: one compile each, where eager calls compile every op one by
  # one. The kernels' calls are recorded as the paired one is traced.
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(x, w)
  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  original = getattr(ct, kernel)

  def interpreted(t, *args, **kw):
    record(t, args, kw)
    return original(t, *args, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, kernel, interpreted)
  with table.target_arch(arch):
    got = jax.jit(grad)(x, w)
  return want, got


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_rowwise_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch, arch):
  """fp8_rowwise traced for Hopper and Blackwell with the row-wise pair
  kernels run in Pallas' interpreter on CPU: x, w and g each take one pair
  (two kernels: the amaxes, then both copies), and the output and
  gradients keep the unpaired matmul's bits."""
  shapes = []
  want, got = _paired_against_unpaired(
      monkeypatch, "fp8_rowwise", arch, "row_cast_transpose",
      lambda t, args, kw: shapes.append(t.shape))
  assert shapes == [(128, 128), (128, 256), (128, 256)]  # x, w, then g
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt,dtype,rule", [
    ("e2m3", jnp.bfloat16, "mx_rceil"), ("e3m2", jnp.float32, "mx_floor")])
def test_mxfp6_copies_are_widened_quantize_of_t_and_t_transposed(fmt, rule,
                                                                 dtype):
  """MXFP6's copies as E4M3 payloads: the values of `scaling.widened` of
  the quantized rows of t and of t.T, bit for bit (the NaN block's zeros,
  saturation past the format's max, values rounding to zero)."""
  t = _data((96, 160), dtype).at[40, 70].set(1e-30)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx",
                                   scale_rule=rule)
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, rule, interpret=True)
  rows, cols = (qlayers.scaling.widened(qlayers.scaling.quantize(a, spec, 1))
                for a in (t, t.T))
  assert q.dtype == qt.dtype == rows.payload.dtype == jnp.float8_e4m3fn
  for got, want in ((q, rows.payload), (s, rows.scale), (qt, cols.payload),
                    (st, cols.scale)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  assert int(s[0, 0]) == 255 and not np.asarray(q[0, :32], np.float32).any()
  # Every payload value is on the FP6 grid (an E4M3 value off it would be
  # another number to the GEMM).
  grid = formats.round_to_format(np.asarray(q, np.float32), fmt)
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(grid))
  with pytest.raises(ValueError, match="MX scale rule"):
    ct.mx_cast_transpose(t, fmt, "deepseek", interpret=True)
  with pytest.raises(ValueError, match="blocks of 32"):
    ct.mx_cast_transpose(t, fmt, rule, block_size=128, interpret=True)


@pytest.mark.parametrize("hadamard", [(16, 32), (0, 32)])
def test_fp4_copies_of_transforms_are_quantize_bit_for_bit(hadamard):
  """With Hadamard transforms (the gradient GEMMs of `mxfp4_rht`,
  `mxfp4_mlperf`): each copy is `scaling.quantize` of its own transform,
  of t along its columns and of t.T along t's rows, rounded to nearest and
  stochastically."""
  t = _data((64, 96), jnp.bfloat16).at[0, 0].set(1.0)
  spec = qlayers.scaling.QuantSpec(format="e2m1", granularity="mx")
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  srcs = [_transform(t, size, axis) if size else t
          for size, axis in zip(hadamard, (1, 0))]
  for k in (None, keys):
    got = ct.fp4_cast_transpose(t, keys=k, hadamard=hadamard, interpret=True)
    rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=kk) for a, kk in
                  zip((srcs[0], srcs[1].T), k or (None, None)))
    for g, w in zip(got, (rows.payload, rows.scale, cols.payload,
                          cols.scale)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="hadamard takes two sizes"):
    ct.fp4_cast_transpose(t, hadamard=(64, 0), interpret=True)


# Each dtype (the load) and each rule (the scale) once.
@pytest.mark.parametrize("dtype,rule", [(jnp.bfloat16, "mx_rceil"),
                                        (jnp.float32, "mx_floor")])
def test_fp4_copies_are_quantize_of_t_and_t_transposed_bit_for_bit(dtype,
                                                                   rule):
  # Scaled values on every E2M1 rounding tie and between them, a zero row,
  # a block under the FP32 normal range, NaN and Inf blocks.
  t = _data((64, 96), dtype).at[9, :].set(0.0).at[40, 70].set(1e-30)
  # (a block whose amax is 6: scale 1, so its elements are their values)
  ties = jnp.zeros(32).at[:25].set(jnp.arange(0.0, 6.25, 0.25)).astype(dtype)
  t = t.at[16, 32:64].set(ties).at[32:64, 64].set(-ties)
  spec = qlayers.scaling.QuantSpec(format="e2m1", granularity="mx",
                                   scale_rule=rule)
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  nearest = None
  for k in (None, keys):
    q, s, qt, st = ct.fp4_cast_transpose(t, rule, keys=k, interpret=True)
    rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=kk) for a, kk in
                  zip((t, t.T), k or (None, None)))
    for got, want in ((q, rows.payload), (s, rows.scale),
                      (qt, cols.payload), (st, cols.scale)):
      assert got.dtype == want.dtype == jnp.uint8
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(s[0, 0]) == 255 and int(st[0, 0]) == 255  # the NaN's blocks
    if nearest is None:
      nearest = q
  assert (np.asarray(q) != np.asarray(nearest)).mean() > 0.2  # it rounded
  with pytest.raises(ValueError, match="multiples of 32"):
    ct.fp4_cast_transpose(t[:48], rule, interpret=True)
  with pytest.raises(ValueError, match="one PRNG key per copy"):
    ct.fp4_cast_transpose(t, rule, keys=keys[:1], interpret=True)


def test_fp4_pair_for_blackwell_is_operand_and_its_transposed_copy():
  t = _data((2, 32, 96), jnp.bfloat16)
  spec = _spec("mxfp4")
  last_op, first_op = Operand(spec, 1), Operand(spec, 0, True)
  want = (operand(t, last_op), operand(t, first_op))
  with table.target_arch("sm_100"):
    assert qlayers.operands.pairable(t, last_op, first_op)
    got = operand_pair(t, last_op, first_op)
    cuda = jax.jit(lambda t: operand_pair(t, last_op, first_op)).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
    sr = dataclasses.replace(spec, rounding="stochastic")
    sr_ops = (Operand(sr, 1), Operand(sr, 0, True))
    assert qlayers.operands.pairable(t, *sr_ops)
    keys = (jax.random.key(1), jax.random.key(2))
    sr_got = operand_pair(t, *sr_ops, keys=keys)
    sr_fp8 = dataclasses.replace(_spec("mxfp8"), rounding="stochastic")
    assert not qlayers.operands.pairable(t, Operand(sr_fp8, 1),
                                         Operand(sr_fp8, 0))
  sr_want = [operand(t, op, key=k) for op, k in zip(sr_ops, keys)]
  for g, w in zip(sr_got, sr_want):
    np.testing.assert_array_equal(np.asarray(g.payload), np.asarray(w.payload))
  for g, w in zip(got, want):
    assert (g.axis, g.block, g.shape, g.transposed) == (
        w.axis, w.block, w.shape, w.transposed)
    np.testing.assert_array_equal(np.asarray(g.payload), np.asarray(w.payload))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))
  assert "qlayers_fp4_cast_transpose" in cuda


@pytest.mark.parametrize("recipe,rule", [
    ("deepseek_v3_ue8m0", "deepseek_pow2"), ("deepseek_v3", "deepseek")])
def test_deepseek_tiles_are_quantize_along_each_axis_bit_for_bit(recipe,
                                                                  rule):
  """DeepSeek-V3 1 x 128 tiles, both ways, with power-of-two scales and
  with correctly rounded ones (max(amax, 1e-4) / 448, its reciprocal the
  multiplier): NaN and Inf tiles, tiles under the 1e-4 amax floor, amaxes
  at 448 * 2**k and just above it (where rounding up to the power of two is
  decided)."""
  spec = qlayers.recipe(recipe).fprop.lhs
  t = _data((256, 384), jnp.bfloat16).at[200:, :128].set(1e-9)
  t = t.at[130, 200].set(448.0 * 4).at[131, 300].set(448.0 * 4 * 1.0078125)
  q, s, qt, st = ct.mx_cast_transpose(t, spec.fmt, rule,
                                      block_size=128, interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  np.testing.assert_array_equal(_bits(q), _bits(rows.payload))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(_bits(qt), _bits(cols.payload).T)
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert np.isnan(np.asarray(s[0, 0])) and s.dtype == jnp.float32


@pytest.mark.parametrize("recipe,arch", [("deepseek_v3_ue8m0", "sm_100"),
                                         ("deepseek_v3", "sm_90")])
def test_square_blocks_in_both_layouts_are_one_quantize(recipe, arch):
  spec = qlayers.recipe(recipe).fprop.rhs
  w = (jax.random.normal(jax.random.key(4), (256, 384)) * 0.02)
  w = w.at[0, 0].set(jnp.nan).at[128:, 128:256].set(1e-9)
  q, s, qt = ct.block_cast_transpose(w, spec.fmt, pow2=spec.pow2,
                                     interpret=True)
  want = qlayers.scaling.quantize(w, spec, 0)
  np.testing.assert_array_equal(_bits(q), _bits(want.payload))
  np.testing.assert_array_equal(_bits(qt), _bits(want.payload).T)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(want.scale))
  with table.target_arch(arch):
    assert qlayers.operands.pairable(w, Operand(spec, 1))
    last, first = operand_pair(w, Operand(spec, 1))
  np.testing.assert_array_equal(_bits(first.payload), _bits(want.payload))
  np.testing.assert_array_equal(np.asarray(last.scale),
                                np.asarray(want.scale))


def test_mx_pair_for_blackwell_holds_operands_values():
  t = _data((2, 32, 96), jnp.bfloat16)
  spec = _spec("mxfp8")
  last_op, first_op = Operand(spec, 1), Operand(spec, 0)
  want = (operand(t, last_op), operand(t, first_op))
  with table.target_arch("sm_100"):
    got = operand_pair(t, last_op, first_op)
    cuda = jax.jit(lambda t: operand_pair(t, last_op, first_op)).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  for g, w in zip(got, want):
    assert (g.axis, g.block, g.shape) == (w.axis, w.block, w.shape)
    np.testing.assert_array_equal(_bits(g.payload), _bits(w.payload))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))
  assert "qlayers_mx_cast_transpose" in cuda
  with table.target_arch("sm_90"):  # emulated there, on the pair's copies
    assert qlayers.operands.pairable(t, last_op, first_op)
  with table.target_arch("sm_89"):  # no kernel before Hopper
    assert not qlayers.operands.pairable(t, last_op, first_op)


@pytest.mark.parametrize("recipe,arch,kernels", [
    ("fp8_current", "sm_90", 3), ("fp8_delayed", "sm_90", 6),
    ("mxfp8", "sm_100", 3), ("mxfp4", "sm_100", 3), ("mxfp6", "sm_100", 3),
    ("mxfp6", "sm_90", 3),
    ("mxfp4_rht", "sm_100", 3),
    ("deepseek_v3_ue8m0", "sm_100", 3), ("deepseek_v3", "sm_90", 3),
    ("fp8_rowwise", "sm_90", 6), ("fp8_rowwise", "sm_100", 6)])
def test_gpu_targeted_gemm_equals_the_cpu_one_on_cpu(recipe, arch, kernels):
  """Traced for a GPU target, a quantized matmul takes the operand pairs;
  run on CPU, its output and all gradients keep their bits."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1
  state = ops.init_state(recipe)

  def loss(x, w, state):
    y, _ = ops.quantized_matmul(x, w, recipe, state)
    return jnp.sum(y * jnp.cos(y))

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  want = jax.jit(grad)(x, w, state)
  with table.target_arch(arch):
    got = jax.jit(grad)(x, w, state)
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  # x, w, g (MXFP4's g rounding stochastically); row-wise's amaxes and a
  # delayed role's first-step amax each in a kernel before the cast
  assert text.count("__gpu$xla.gpu.triton") == kernels
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Each algorithm (the history the kernel takes: whole, or its amax) and each
# arch (two layouts or one) once: the two are apart in the pair.
@pytest.mark.parametrize("algo,arch", [("max", "sm_90"),
                                       ("most_recent", "sm_100")])
def test_delayed_pairs_run_the_kernel_on_the_roles_state(monkeypatch, algo,
                                                         arch):
  """fp8_delayed traced for Hopper (two layouts) and Blackwell (one), with
  the kernels run in Pallas' interpreter on CPU: each kernel takes its own
  role's history and running amax, and output, gradients and state keep
  the bits of the unpaired matmul, on the first step and on one whose
  history decides."""
  def kernel_branch(*args, cuda, **_):
    return cuda(*args)

  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent": kernel_branch}))
  calls, kernel = [], ct.cast_transpose

  def interpreted(*args, delayed=None, **kw):
    calls.append((delayed is not None, kw.get("transpose", True)))
    return kernel(*args, delayed=delayed, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, "cast_transpose",
                      interpreted)
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1
  recipe = qlayers.recipe("fp8_delayed").replace(amax_history_len=8,
                                                 amax_compute_algo=algo)
  first = ops.init_state(recipe)
  # Histories whose max is far from the data's amax, per role: the wrong
  # role's state would change the scale, and so the bits.
  later = {role: st._replace(
      amax_history=st.amax_history.at[1].set(a / 2).at[3].set(a),
      amax=jnp.float32(a / 4))
           for (role, st), a in zip(first.items(), (9.0, 0.3, 0.02))}

  def loss(x, w, state):
    y, new_state = ops.quantized_matmul(x, w, recipe, state)
    return jnp.sum(y * jnp.cos(y)), new_state

  # Jitted (one compile each, not one per op): both states run the one
  # program, so the kernels' calls are recorded once, as it is traced.
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  unpaired, paired = jax.jit(grad), jax.jit(lambda *a: grad(*a))
  for state in (first, later):
    want = unpaired(x, w, state)
    with table.target_arch(arch):
      got = paired(x, w, state)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert calls == [(True, arch == "sm_90")] * 3  # x, w, then g


def _nvfp4_spec(granularity="tile"):
  return qlayers.scaling.QuantSpec(format="e2m1", granularity=granularity,
                                   scale_rule="nvfp4")


def _nvfp4_data(dtype):
  # Scaled values on E2M1 ties and between them, a zero row, a block far
  # under the tensor's amax (its E4M3 scale underflows to 0), tiny values.
  t = jax.random.normal(jax.random.key(4), (64, 96), jnp.float32) * 30.0
  t = t.at[9, :].set(0.0).at[40, 16:32].set(1e-6).at[17, 70].set(-2e-30)
  ties = jnp.arange(0.0, 4.0, 0.25)
  return t.at[16, 32:48].set(ties).at[48:64, 64].set(-ties).astype(dtype)


# Each dtype (the load) and each layout of the transform once.
@pytest.mark.parametrize("dtype,hadamard", [(jnp.float32, False),
                                            (jnp.bfloat16, True)])
def test_nvfp4_copies_are_quantize_of_t_and_t_transposed_bit_for_bit(
    dtype, hadamard):
  """Both 1 x 16 copies, payloads and E4M3 scales, equal
  `scaling.quantize` of ``t`` and of ``t.T`` (of its 16-point transform if
  ``hadamard``), rounded to nearest and stochastically; a non-finite
  element makes its own block's scale NaN, and a non-finite tensor amax
  every block's."""
  spec = _nvfp4_spec()
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  t = _nvfp4_data(dtype)
  src = _transform(t, 16, 0) if hadamard else t
  inf = t.at[3, 7].set(jnp.inf)
  for amaxes in ((None, None), (jnp.float32(500.0), jnp.float32(90.0)),
                 (jnp.float32(jnp.inf), jnp.float32(jnp.nan))):
    nearest = None
    for k in (None, keys):
      q, s, qt, st = ct.nvfp4_cast_transpose(t, *amaxes, hadamard=hadamard,
                                             keys=k, interpret=True)
      rows, cols = (qlayers.scaling.quantize(a, spec, 1, amax=am, key=kk)
                    for a, am, kk in zip((t, src.T), amaxes, k or (None,) * 2))
      for got, want in ((q, rows.payload), (s, rows.block_scale),
                        (qt, cols.payload), (st, cols.block_scale)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))
      nearest = q if nearest is None else nearest
    if amaxes[0] is None or np.isfinite(amaxes[0]):  # else NaN payloads
      assert (np.asarray(q) != np.asarray(nearest)).mean() > 0.1  # it rounded
  assert np.isnan(np.asarray(s, np.float32)).all()  # Inf tensor amax
  for data in (t, inf, t.at[60, 90].set(jnp.nan)):
    got = ct.nvfp4_amaxes(data, interpret=True)
    want = (qlayers.blocks.amax(data),
            qlayers.blocks.amax(_transform(data, 16, 0)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q, s, qt, st = ct.nvfp4_cast_transpose(inf, hadamard=hadamard,
                                         interpret=True)
  assert np.isnan(np.asarray(s, np.float32)).all()  # the amax is Inf
  q, s, _, _ = ct.nvfp4_cast_transpose(inf, jnp.float32(100.0),
                                       jnp.float32(100.0), interpret=True)
  nan = np.isnan(np.asarray(s, np.float32))
  assert nan[3, 0] and nan.sum() == 1  # only the Inf's block


def test_nvfp4_copies_of_dims_not_multiples_of_32_take_tiles_of_16():
  """A tensor whose dims are multiples of 16 but not of 32 runs the NVFP4
  kernels on 16-row, 16-column tiles: the same amaxes, the same copies,
  1 x 16 (stochastic and transformed) and in 16 x 16 blocks."""
  spec = _nvfp4_spec()
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(2)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(2)))
  t = _nvfp4_data(jnp.bfloat16)[:48, :80]
  for data in (t, t[:32]):  # 16-row tiles; 32-row tiles, 16-column ones
    got = ct.nvfp4_amaxes(data, interpret=True)
    want = (qlayers.blocks.amax(data),
            qlayers.blocks.amax(_transform(data, 16, 0)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q, s, qt, st = ct.nvfp4_cast_transpose(t, hadamard=True, keys=keys,
                                         interpret=True)
  rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=k)
                for a, k in zip((t, _transform(t, 16, 0).T), keys))
  for got, want in ((q, rows.payload), (s, rows.block_scale),
                    (qt, cols.payload), (st, cols.block_scale)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  square = _nvfp4_spec("block")
  got = ct.nvfp4_cast_transpose(t, square=True, interpret=True)
  for a, (q, s) in zip((t, t.T), (got[:2], got[2:])):
    want = qlayers.scaling.quantize(a, square, 1)
    np.testing.assert_array_equal(_bits(q), _bits(want.payload))
    np.testing.assert_array_equal(_bits(s), _bits(want.block_scale))


def test_nvfp4_square_blocks_are_one_quantize_in_both_layouts():
  spec = _nvfp4_spec("block")
  t = _nvfp4_data(jnp.float32)
  q, s, qt, st = ct.nvfp4_cast_transpose(t, square=True, interpret=True)
  for got, want in zip((q, s, qt, st), (
      *(lambda a: (a.payload, a.block_scale))(
          qlayers.scaling.quantize(t, spec, 1)),
      *(lambda a: (a.payload, a.block_scale))(
          qlayers.scaling.quantize(t.T, spec, 1)))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
  with pytest.raises(ValueError, match="multiples of 16"):
    ct.nvfp4_cast_transpose(t[:40], interpret=True)
  with pytest.raises(ValueError, match="square blocks"):
    ct.nvfp4_cast_transpose(t, square=True, hadamard=True, interpret=True)
  with pytest.raises(ValueError, match="one PRNG key per copy"):
    ct.nvfp4_cast_transpose(t, keys=(jax.random.key(0),), interpret=True)


def test_nvfp4_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch):
  """nvfp4 traced for Blackwell with the pair kernels run in Pallas'
  interpreter on CPU: x (transformed Wgrad copy), w (16 x 16 blocks) and g
  (stochastic, transformed) each take one kernel, and the output and
  gradients keep the bits of the unpaired matmul; the lowering for CUDA
  holds the three kernels."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1
  recipe = qlayers.recipe("nvfp4")
  state = ops.init_state(recipe)

  def loss(x, w, state):  # g's rounding keys from the call's key, as layers
    y, new_state = ops.quantized_matmul(x, w, recipe, state,
                                        key=jax.random.key(3))
    return jnp.sum(y * jnp.cos(y)), new_state

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  want = jax.jit(grad)(x, w, state)  # one compile, not one per op
  with table.target_arch("sm_100"):
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  # x and g: both amaxes in one kernel, then the pair; w: the pair.
  kernels = re.findall(r'name = "(qlayers_\w+)"', text)
  assert sorted(kernels) == ["qlayers_nvfp4_amaxes"] * 2 + [
      "qlayers_nvfp4_cast_transpose"] * 3

  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  calls, kernel = [], ct.nvfp4_cast_transpose

  def interpreted(*args, **kw):
    calls.append((kw["square"], kw["hadamard"], kw["keys"] is not None))
    return kernel(*args, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, "nvfp4_cast_transpose",
                      interpreted)
  monkeypatch.setattr(qlayers.operands.cast_transpose, "nvfp4_amaxes",
                      functools.partial(ct.nvfp4_amaxes, interpret=True))
  with table.target_arch("sm_100"):  # a new function: traced anew
    got = jax.jit(lambda *a: grad(*a))(x, w, state)
  assert calls == [(False, True, False), (True, False, False),
                   (False, True, True)]  # x, w, then g
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Each recipe (the formats) and each arch (which copies are dequantized)
# once; the kernel's copies of the other two pairs are pinned bit for bit
# by test_mxfp6_copies_are_widened_quantize_of_t_and_t_transposed and
# test_dequantized_mx_copies_are_the_bf16_values_bit_for_bit[e4m3].
@pytest.mark.parametrize("recipe,formats_made,arch", [
    ("mxfp6", ["e2m3", "e2m3", "e3m2"], "sm_90"),
    ("mxfp8", ["e4m3"] * 3, "sm_100")])
def test_mx_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch, recipe, formats_made, arch):
  """mxfp6 and mxfp8 traced for Blackwell (cuDNN's MXFP8 GEMM) and Hopper
  (BF16 GEMMs on dequantized copies), with the pair kernels run in Pallas'
  interpreter on CPU: x, w and g each take one kernel, whose copies (MXFP6
  in E4M3; on Hopper the BF16 dequantized values where a GEMM reads them at
  once) hand the GEMMs the unpaired operands' values: output and gradients
  keep the unpaired matmul's bits."""
  made = []
  want, got = _paired_against_unpaired(
      monkeypatch, recipe, arch, "mx_cast_transpose",
      lambda t, args, kw: made.append(
          (formats.get_format(args[0]).name, kw["dequantized"])))
  # x, w, then g; dequantized where no MX tensor cores read them, but the
  # copies kept for the backward pass (x's for Wgrad, w's for Dgrad) stay
  # quantized.
  hopper = arch == "sm_90"
  assert made == [(f, d) for f, d in zip(formats_made, [
      (hopper, False), (False, hopper), (hopper, hopper)])]
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# E2M3's dequantized copies: test_mx_matmul_runs_the_pair_kernels_with_the_
# operands_bits[mxfp6-...-sm_90] (x's, into the Fprop GEMM, bit for bit).
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2"])
def test_dequantized_mx_copies_are_the_bf16_values_bit_for_bit(fmt):
  """``dequantized`` copies: `scaling.dequantized` of the quantized rows of
  t and t.T (NaN for the NaN's block, the subnormal scale of a block of
  tiny values), with the same E8M0 scales."""
  t = _data((96, 160), jnp.float32).at[64:, 128:].set(1e-39)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx")
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, "mx_rceil",
                                      dequantized=(True, True),
                                      interpret=True)
  rows, cols = (qlayers.scaling.dequantized(
      qlayers.scaling.quantize(a, spec, 1)) for a in (t, t.T))
  assert q.dtype == qt.dtype == jnp.bfloat16
  for got, want in ((q, rows.payload), (s, rows.scale), (qt, cols.payload),
                    (st, cols.scale)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  assert np.isnan(np.asarray(q[0, 0], np.float32))
  assert rows.dequantized
  np.testing.assert_array_equal(
      np.asarray(rows.dequantize()),
      np.asarray(qlayers.scaling.quantize(t, spec, 1).dequantize(
          jnp.bfloat16), np.float32))
  with pytest.raises(ValueError, match="dequantized values"):
    rows.elements()
  with pytest.raises(ValueError, match="MX scale rule"):
    ct.mx_cast_transpose(jnp.ones((128, 128)), "e4m3", "deepseek_pow2",
                         block_size=128, dequantized=(True, False),
                         interpret=True)
  # One copy dequantized, the other as quantized.
  q2, _, qt2, _ = ct.mx_cast_transpose(t, fmt, "mx_rceil",
                                       dequantized=(False, True),
                                       interpret=True)
  np.testing.assert_array_equal(np.asarray(qt2).view(np.uint8),
                                np.asarray(qt).view(np.uint8))
  assert q2.dtype == (jnp.float8_e4m3fn if fmt in ("e4m3", "e2m3", "e3m2")
                      else jnp.float8_e5m2)


@pytest.mark.parametrize("size,axis,shape", [
    (16, 0, (512, 48)), (32, 0, (64, 32)), (256, 0, (256, 16)),
    (32, 1, (24, 96)), (128, 1, (8, 256))])
def test_transform_kernel_is_the_hadamard_transform_bit_for_bit(size, axis,
                                                                 shape):
  t = (jax.random.normal(jax.random.key(size), shape) * 3).astype(
      jnp.bfloat16)
  t = t.at[1, 1].set(jnp.inf)  # its block's outputs Inf or NaN, as XLA's
  got = ct.transform(t, size, axis, interpret=True)
  want = _transform(t, size, axis)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="multiple of"):
    ct.transform(t[:, :-1] if axis else t[:-1], size, axis, interpret=True)


def test_hadamard_recipe_runs_the_transform_kernel_with_its_bits(
    monkeypatch):
  """mxfp4_mlperf (Dgrad and Wgrad transformed) traced for Blackwell:
  each transformed operand is the one-pass kernel's (in the CUDA
  lowering), and with the kernels interpreted on CPU the output and
  gradients keep the bits of the CPU program."""
  # Dims that are multiples of 16, not 32: no MXFP4 pair kernel, so each
  # transformed operand is quantized in XLA's passes, from the kernel's.
  x = jax.random.normal(jax.random.key(1), (2, 24, 48), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (48, 80), jnp.float32) * 0.1
  recipe = qlayers.recipe("mxfp4_mlperf")
  state = ops.init_state(recipe)

  def loss(x, w, state):
    y, _ = ops.quantized_matmul(x, w, recipe, state)
    return jnp.sum(y * jnp.cos(y))

  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(x, w, state)  # one compile, not one per op
  with table.target_arch("sm_100"):
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "qlayers_hadamard_transform" in text
  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  calls, kernel = [], ct.transform

  def interpreted(t, size, axis):
    calls.append((size, axis))
    return kernel(t, size, axis, interpret=True)

  monkeypatch.setattr(qlayers.operands.cast_transpose, "transform",
                      interpreted)
  with table.target_arch("sm_100"):  # a new function: traced anew
    got = jax.jit(lambda *a: grad(*a))(x, w, state)
  assert sorted(calls) == [(16, 0), (16, 0), (16, 1), (16, 1)]  # x, g; g, w
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_words_hold_eight_codes_low_nibble_first():
  """The 4-bit kernels' words: a row's elements apart (`_lanes.split_last`),
  eight to a word, element ``8i + j`` in bits ``4j``, so their bytes are
  the packed payload."""
  x = jax.random.normal(jax.random.key(4), (4, 64), jnp.float32) * 4
  parts = _lanes.split_last(x)
  for j, part in enumerate(parts):
    np.testing.assert_array_equal(part, x[:, j])
  words = _lanes.join_last([_e2m1.e2m1_word(parts[k:k + 8])
                            for k in range(0, 64, 8)])
  codes = np.asarray(formats.cast(x, "e2m1"))
  got = _lanes.words_to_bytes(words)
  np.testing.assert_array_equal(got, codes[:, 0::2] | (codes[:, 1::2] << 4))


@pytest.mark.parametrize("recipe,ptx,converts", [
    ("mxfp4", "e2m1x2", {"sm_100": True, "sm_90": False}),
    ("nvfp4", "e2m1x2", {"sm_100": True, "sm_90": False}),
    ("mxfp6", "e2m3x2", {"sm_100": True, "sm_90": False}),
    ("mxfp8", "e4m3x2", {"sm_100": True}),
    ("deepseek_v3", "e4m3x2", {"sm_90": True})])
def test_kernels_cast_by_ptx_conversions_where_the_target_has_them(
    recipe, ptx, converts):
  """Traced for a GPU the cast kernels round to nearest with its PTX
  conversions (FP4 and FP6: Blackwell's), written as words, and truncate
  the stochastic copies' steps by PTX; without them (Hopper's FP4/FP6, the
  interpreter) with FP32 steps, whose bits the tests above check."""
  x, w = jnp.ones((256, 256)), jnp.ones((256, 256))

  def loss(x, w):
    return jnp.sum(ops.quantized_matmul(x, w, recipe)[0])

  for arch, want in converts.items():
    with table.target_arch(arch):
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(
          lowering_platforms=("cuda",)).as_text()
    assert (f"cvt.rn.satfinite.{ptx}.f32" in text) == want, arch
    if recipe in ("mxfp4", "nvfp4"):  # their stochastic gradient copies
      assert ("cvt.rzi.u32.f32" in text) == want, arch
      assert ("mul.wide.u32" in text) == want, arch  # Threefry's rotations


def _run_rotl_ptx(asm: str, x: np.ndarray) -> np.ndarray:
  """`_base.ROTL_WIDE`'s statements run on uint64 ``x`` (32-bit values), the
  three opcodes it uses and no other."""
  regs = {"$1": x}
  for stmt in (t.strip() for t in asm.strip("{} ").split(";")):
    if not stmt or stmt.startswith(".reg") or stmt in ("{", "}"):
      continue
    op, args = stmt.split(None, 1)
    args = [a.strip() for a in args.replace("{", "").replace("}", "").split(
        ",")]
    if op == "mul.wide.u32":
      regs[args[0]] = regs[args[1]] * np.uint64(int(args[2]))
    elif op == "mov.b64":  # {lo, hi} = w
      regs[args[0]] = regs[args[2]] & np.uint64(2**32 - 1)
      regs[args[1]] = regs[args[2]] >> np.uint64(32)
    elif op == "or.b32":
      regs[args[0]] = regs[args[1]] | regs[args[2]]
    else:
      raise AssertionError(f"unexpected PTX statement {stmt!r}")
  return regs["$0"].astype(np.uint32)


def test_the_wide_multiply_rotation_is_threefrys():
  """`_base.ROTL_WIDE` for each of Threefry's rotation distances, its PTX run
  statement by statement: the or of the halves of x * 2**d in 64 bits is
  `qlayers.threefry`'s rotation of x."""
  x = np.random.default_rng(3).integers(0, 2**32, 4096, dtype=np.uint64)
  x[:3] = (0, 2**32 - 1, 2**31)
  for d in {d for group in threefry._ROTATIONS for d in group}:  # noqa: SLF001
    got = _run_rotl_ptx(_base.ROTL_WIDE % (1 << d), x)
    want = threefry._rotl(jnp.asarray(x, jnp.uint32), d)  # noqa: SLF001
    np.testing.assert_array_equal(got, np.asarray(want))
