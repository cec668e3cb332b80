"""The per-tensor and row-wise FP8 cast kernels (qlayers/cast_transpose/fp8.py),
delayed scaling's amax found as they cast, and the operand pairs built on
them (qlayers/operands.py: operand_pair)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
import qlayers.scaling
from qlayers import cast_transpose as ct
from qlayers.cast_transpose import fp8
from qlayers import formats
from qlayers import ops
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.operands import operand, operand_pair
from _support import cast_kernels as ck


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
  special = ck.data((128, 192), dtype)
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
    np.testing.assert_array_equal(ck.bits(q), ck.bits(want), str(amax))
    np.testing.assert_array_equal(ck.bits(qt), ck.bits(want).T, str(amax))
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
  finite = ck.data((128, 192), jnp.bfloat16).at[:3, :6].set(-5e3)
  finite = finite.at[0, 0].set(1.0).at[1, 3].set(2.0).at[2, 5].set(3.0)
  special = ck.data((128, 192), jnp.bfloat16)
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
        want = ck.bits(formats.cast(t.astype(jnp.float32) * mult, fmt))
        q, qt, scale, new_running = ct.cast_transpose(
            t, fmt, amax=amax, delayed=(history, jnp.float32(running)),
            margin=margin, pow2=pow2, interpret=True)
        what = f"{history[:4]} {running} {amax is None} {t is special}"
        np.testing.assert_array_equal(
            np.float32(new_running).view(np.uint32),
            np.float32(want_running).view(np.uint32), what)
        np.testing.assert_array_equal(ck.bits(q), want, what)
        np.testing.assert_array_equal(ck.bits(qt), want.T, what)
        np.testing.assert_array_equal(ck.bits(np.float32(scale)),
                                      ck.bits(np.float32(want_scale)), what)
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
    special = ck.data(shape, jnp.float32)  # NaN, +-Inf among the values
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
  t = ck.data((128, 192), jnp.bfloat16)
  finite = t.at[0, 0].set(1.0).at[1, 3].set(2.0).at[2, 5].set(3.0)
  for data, delayed in [(finite, None), (t, None),
                        (finite, (jnp.asarray(_STATES[3][0], jnp.float32),
                                  jnp.float32(_STATES[3][1])))]:
    two = ct.cast_transpose(data, "e4m3", delayed=delayed, interpret=True)
    one = ct.cast_transpose(data, "e4m3", delayed=delayed,
                            transpose=False, interpret=True)
    assert one[1] is None and len(one) == len(two) == 3 + (delayed is not None)
    np.testing.assert_array_equal(ck.bits(one[0]), ck.bits(two[0]))
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


def test_pair_on_cpu_is_the_one_copy():
  t = ck.data((2, 64, 128), jnp.bfloat16)
  last, first = operand_pair(t, Operand(ck.spec(), 1))
  assert last is first  # no GPU targeted: nothing changes
  mx = ck.spec("mxfp8")
  assert not qlayers.operands.pairable(t, Operand(mx, 1), Operand(mx, 0))


def test_pair_for_a_gpu_holds_the_same_values_and_lowers_to_the_kernel():
  t = ck.data((2, 64, 128), jnp.bfloat16)
  ref = operand(t, Operand(ck.spec(), 1))
  with table.target_arch("sm_90"):
    last, first = operand_pair(t, Operand(ck.spec(), 1))
    cuda = jax.jit(lambda t: operand_pair(t, Operand(ck.spec(), 1))).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  for q in (last, first):  # run on CPU: XLA's branch
    assert q.payload.shape == (128, 128)
    np.testing.assert_array_equal(ck.bits(q.payload), ck.bits(ref.payload))
    np.testing.assert_array_equal(q.scale, ref.scale)
  assert cuda.count("__gpu$xla.gpu.triton") == 1
  assert "qlayers_cast_transpose" in cuda
  with table.target_arch("sm_100"):  # Blackwell's FP8 GEMM takes any layout
    last, first = operand_pair(t, Operand(ck.spec(), 1))
    cuda = jax.jit(lambda t: operand_pair(t, Operand(ck.spec(), 1))).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  assert last is first  # one copy, the kernel's, in one layout
  np.testing.assert_array_equal(ck.bits(last.payload), ck.bits(ref.payload))
  assert cuda.count("__gpu$xla.gpu.triton") == 1
  assert "qlayers_cast" in cuda and "qlayers_cast_transpose" not in cuda


@pytest.mark.parametrize("shape", [(2, 64, 100), (2, 64, 128)])
def test_pair_keeps_operand_where_the_kernel_does_not_apply(shape):
  t = jnp.ones(shape, jnp.bfloat16)
  with table.target_arch("sm_90"):
    for spec in (ck.spec("mxfp8"), ck.spec("fp8_current")):
      last, first = operand_pair(t, Operand(spec, 1))
      one_copy = spec.granularity != "tensor" or shape[-1] % ct.TILE
      assert (last is first) == bool(one_copy)


@pytest.mark.parametrize("fmt,margin,pow2,dtype", [
    ("e4m3", 0, True, jnp.bfloat16), ("e5m2", 2, False, jnp.float32)])
def test_row_copies_are_quantize_along_each_axis_bit_for_bit(fmt, margin,
                                                             pow2, dtype):
  """Row-wise copies: scaled per row and per column (transposed), with
  TE's rule, equal `scaling.quantize` along axis 1 and axis 0 bit for bit:
  a NaN and an Inf row and column, a zero row, a column of values that
  round to zero, overflow past the format's max."""
  t = ck.data((192, 256), dtype).at[70, :].set(0.0).at[:, 200].set(1e-38)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="row",
                                   margin=margin, pow2=pow2)
  q, s, qt, st = ct.row_cast_transpose(t, fmt, margin=margin, pow2=pow2,
                                       interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  for got, want in ((q, rows.payload), (qt, cols.payload.T)):
    np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert np.isnan(np.asarray(s[0, 0])) and float(s[70, 0]) == 1.0
  with pytest.raises(ValueError, match="multiples of"):
    ct.row_cast_transpose(t[:100], fmt, interpret=True)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_rowwise_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch, arch):
  """fp8_rowwise traced for Hopper and Blackwell with the row-wise pair
  kernels run in Pallas' interpreter on CPU: x, w and g each take one pair
  (two kernels: the amaxes, then both copies), and the output and
  gradients keep the unpaired matmul's bits."""
  shapes = []
  want, got = ck.paired_against_unpaired(
      monkeypatch, "fp8_rowwise", arch, "row_cast_transpose",
      lambda t, args, kw: shapes.append(t.shape))
  assert shapes == [(128, 128), (128, 256), (128, 256)]  # x, w, then g
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
