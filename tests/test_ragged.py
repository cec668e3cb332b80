"""The quantized grouped GEMM (`qlayers.ops.ragged_dot`): bit-identical to a
loop over experts of the dense op, for every recipe's path, forward and both
gradients; delayed scaling per expert; refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
from qlayers import ops
from qlayers import ragged

M, K, N = 40, 64, 64
# An empty group, and sizes that are not multiples of any scaling block.
SIZES = (9, 0, 31)
STARTS = np.concatenate([[0], np.cumsum(SIZES)])
DN = (((1,), (0,)), ((), ()))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(SIZES), K, N)) * 0.1, jnp.float32)
  ct = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  return x, w, ct


def _nearest(r):
  """``r`` with round-to-nearest everywhere (stochastic rounding draws its
  noise per buffer, so only the deterministic GEMMs compare in bits)."""
  def fix(spec):
    if spec is None or spec.rounding != "stochastic":
      return spec
    return dataclasses.replace(spec, rounding="nearest")
  gemms = {name: dataclasses.replace(getattr(r, name),
                                     lhs=fix(getattr(r, name).lhs),
                                     rhs=fix(getattr(r, name).rhs))
           for name in ("fprop", "dgrad", "wgrad")}
  return dataclasses.replace(r, name=r.name + "_nearest", sr_key="data",
                             **gemms)


def _stochastic(r):
  return any(s is not None and s.rounding == "stochastic"
             for g in (r.fprop, r.dgrad, r.wgrad) for s in (g.lhs, g.rhs))


def _ragged_fn(r):
  rd = ops.ragged_dot(r)
  def f(x, w, ct):
    y = rd(x, w, jnp.array(SIZES, jnp.int32),
           preferred_element_type=jnp.float32)
    return y, jnp.sum(y * ct)
  return f


def _loop_fn(r):
  dg = ops.dot_general(r)
  def f(x, w, ct):
    ys = [dg(x[a:b], w[e], DN, preferred_element_type=jnp.float32)
          for e, (a, b) in enumerate(zip(STARTS[:-1], STARTS[1:]))]
    y = jnp.concatenate(ys)
    return y, jnp.sum(y * ct)
  return f


def _run(f, x, w, ct):
  """``(y, dx, dw)`` of ``f``, jitted."""
  def go(x, w, ct):
    (_, y), (dx, dw) = jax.value_and_grad(
        lambda x, w: f(x, w, ct)[::-1], (0, 1), has_aux=True)(x, w)
    return y, dx, dw
  return jax.jit(go)(x, w, ct)


# Recipes whose operands take the same path here as another's, differing
# only in a value the per-expert and the looped GEMMs compute alike:
# deepseek_v3_ue8m0 is deepseek_v3 with power-of-two scales; mxfp4 is
# mxfp4_rht's FP4 path without the Hadamard (so is mxfp4_mlperf, whose
# 16-point Hadamard differs from mxfp4_rht's in size only, and nvfp4 has a
# 16-point one on Wgrad).
COVERED = {"deepseek_v3_ue8m0": "deepseek_v3", "mxfp4": "mxfp4_rht",
           "mxfp4_mlperf": "mxfp4_rht"}
STATELESS = [n for n in qlayers.available_recipes()
             if not qlayers.recipe(n).delayed and n not in COVERED]


@pytest.mark.parametrize("name", STATELESS)
def test_bit_identical_to_loop_over_experts(name):
  r = qlayers.recipe(name)
  if _stochastic(r):
    r = _nearest(r)
  x, w, ct = _data()
  got = _run(_ragged_fn(r), x, w, ct)
  want = _run(_loop_fn(r), x, w, ct)
  for what, a, b in zip(("y", "dx", "dw"), got, want):
    if r.fprop.lhs is None and r.fprop.rhs is None:
      # Nothing quantized: the same BF16 products summed in FP32, in an
      # order XLA:CPU picks per GEMM shape (jax 0.12 differs by 1 ulp).
      np.testing.assert_allclose(a, b, rtol=0, err_msg=f"{name}: {what}",
                                 atol=2**-20 * float(np.abs(b).max()))
      continue
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=f"{name}: {what}")
  # The empty expert gets no gradient.
  assert not np.asarray(got[2][1]).any()


def test_stochastic_recipes_stay_accurate(sqnr):
  """Stochastic rounding draws per-expert-buffer noise: not the loop's bits,
  but the same accuracy against FP32."""
  x, w, ct = _data(1)
  def wide(x, w, ct):
    y = jax.lax.ragged_dot(x, w, jnp.array(SIZES, jnp.int32),
                           precision=jax.lax.Precision.HIGHEST)
    return y, jnp.sum(y * ct)
  ref = _run(wide, x, w, ct)
  got = _run(_ragged_fn(qlayers.recipe("mxfp4")), x, w, ct)
  for what, a, b in zip(("y", "dx", "dw"), got, ref):
    assert sqnr(b, a) > 8, (what, sqnr(b, a))


def test_delayed_keeps_one_history_per_expert():
  r = qlayers.recipe("fp8_delayed")
  x, w, ct = _data(2)
  w = w * jnp.array([1.0, 2.0, 4.0])[:, None, None]
  state = ragged.init_state(r, len(SIZES))
  # Histories of earlier steps. Expert 1, given no tokens, keeps its state
  # as `quantized_matmul` of an empty batch does (it recorded its weight's
  # amax: found by audit).
  state = {k: v._replace(amax_history=v.amax_history.at[:, 0].set(3.0))
           for k, v in state.items()}
  gs = jnp.array(SIZES, jnp.int32)

  def loss(x, w, state):
    y, new = ops.quantized_ragged_dot(x, w, gs, r, state,
                                      out_dtype=jnp.float32)
    return jnp.sum(y * ct), (y, new)

  (_, (y, new)), (dx, dw, dstate) = jax.jit(jax.value_and_grad(
      loss, (0, 1, 2), has_aux=True))(x, w, state)
  amax_w = jnp.max(jnp.abs(w), axis=(1, 2)).at[1].set(0.0)
  np.testing.assert_array_equal(new["w"].amax, amax_w)
  want_x = [float(jnp.max(jnp.abs(x[a:b]))) if b > a else 0.0
            for a, b in zip(STARTS[:-1], STARTS[1:])]
  np.testing.assert_array_equal(new["x"].amax, want_x)
  for role in ("x", "w"):  # the whole state, history included
    np.testing.assert_array_equal(new[role].amax_history[1],
                                  state[role].amax_history[1])
  want_g = [float(jnp.max(jnp.abs(ct[a:b]))) if b > a else 0.0
            for a, b in zip(STARTS[:-1], STARTS[1:])]
  np.testing.assert_array_equal(dstate["g"].amax, want_g)
  # Against the dense op on each expert's tokens, with that expert's state.
  e, (a, b) = 2, STARTS[2:4]
  st = jax.tree.map(lambda t: t[e], state)
  def one(xe, we, st):
    ye, _ = ops.quantized_matmul(xe, we, r, st, out_dtype=jnp.float32)
    return jnp.sum(ye * ct[a:b]), ye
  (_, ye), (dxe, dwe, _) = jax.jit(jax.value_and_grad(
      one, (0, 1, 2), has_aux=True))(x[a:b], w[e], st)
  _same_sums(y[a:b], ye)
  _same_sums(dx[a:b], dxe)
  _same_sums(dw[e], dwe)


def test_two_uses_max_combine_an_idle_experts_gradient_amax():
  """Two uses in one step, the state's g amax already 0.25 (an earlier
  micro-batch): an expert idle in the first use and busy in the second
  gets the max of the amaxes, not their sum (an early form of the idle
  experts' state select added them: found by review)."""
  r = qlayers.recipe("fp8_delayed")
  x, w, ct = _data(3)
  state = {k: v._replace(amax=v.amax + 0.25)
           for k, v in ragged.init_state(r, len(SIZES)).items()}
  first, second = jnp.array([9, 31, 0]), jnp.array([9, 0, 31])

  def loss(w, state):
    y1, s1 = ops.quantized_ragged_dot(x, w, first, r, state,
                                      out_dtype=jnp.float32)
    y2, _ = ops.quantized_ragged_dot(x, w, second, r, s1,
                                     out_dtype=jnp.float32)
    return jnp.sum(y1 * ct) + jnp.sum(y2 * ct * 0.5)

  dstate = jax.grad(loss, 1)(w, state)
  a = np.abs(np.asarray(ct))
  want = [max(a[:9].max(), 0.25), max(a[9:].max(), 0.25),
          max(0.5 * a[9:].max(), 0.25)]
  np.testing.assert_array_equal(dstate["g"].amax, np.float32(want))


def test_group_sizes_as_a_python_list():
  # Was: "Cannot determine dtype" from the shape check (found by audit).
  x, w, _ = _data()
  want, _ = ops.quantized_ragged_dot(x, w, jnp.array(SIZES, jnp.int32),
                                     "mxfp8")
  got, _ = ops.quantized_ragged_dot(x, w, list(SIZES), "mxfp8")
  np.testing.assert_array_equal(got, want)


def test_rows_past_the_groups_are_zero():
  x, w, _ = _data()
  gs = jnp.array([3, 0, 10], jnp.int32)
  y = jax.jit(ops.ragged_dot("mxfp8"))(x, w, gs)
  want = jax.lax.ragged_dot(x, w, gs)
  assert not np.asarray(y[13:]).any()
  assert np.asarray(y[:13]).all() and not np.asarray(want[13:]).any()


def test_groups_past_the_rows_are_clipped():
  """Sizes summing past the rows: a group keeps its rows up to the last
  (as `lax.ragged_dot`), and its scales see no other group's rows."""
  x, w, _ = _data(5)
  x = x.at[:30].mul(1e5)  # a large first group, a small second one
  gs = jnp.array([30, 25, 7], jnp.int32)  # 62 > M = 40 rows
  starts, sizes = ragged._layout(gs, M)
  np.testing.assert_array_equal(starts, [0, 30, 40])
  np.testing.assert_array_equal(sizes, [30, 10, 0])
  want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
  y = ops.ragged_dot("fp8_current")(x, w, gs,
                                    preferred_element_type=jnp.float32)
  err = np.abs(np.asarray(y - want)).max(axis=1)
  scale = np.abs(np.asarray(want)).max(axis=1)
  assert (err[30:] < 0.1 * scale[30:]).all(), err[30:] / scale[30:]


def _same_sums(a, b):
  """GEMM outputs of the same quantized operands from GEMMs of other
  shapes (an expert's buffer, its dense rows): XLA:CPU's BF16 GEMM sums
  them in an order its shape picks on CPUs with AMX-BF16, so the last FP32
  bit may differ; the operands' bits are checked where made."""
  np.testing.assert_allclose(a, b, rtol=0,
                             atol=2**-20 * float(np.abs(b).max()))


def test_capacity_bounds_the_buffers():
  """``capacity``: buffers [G, capacity, K]; a capacity every group fits
  changes no bit, a smaller one drops each group's rows past it."""
  x, w, ct = _data(3)
  def run(capacity):
    rd = ops.ragged_dot("mxfp8", capacity=capacity)
    def f(x, w, ct):
      y = rd(x, w, jnp.array(SIZES, jnp.int32),
             preferred_element_type=jnp.float32)
      return y, jnp.sum(y * ct)
    return _run(f, x, w, ct)
  full, fits, small = run(None), run(max(SIZES)), run(5)
  for a, b in zip(full, fits):
    _same_sums(a, b)
  kept = np.r_[0:5, 9:14]
  dropped = np.r_[5:9, 14:40]
  _same_sums(small[0][kept], full[0][kept])
  assert not np.asarray(small[0][dropped]).any()
  assert not np.asarray(small[1][dropped]).any()
  _same_sums(small[1][kept], full[1][kept])
  with pytest.raises(ValueError, match="capacity must be a positive int"):
    ops.ragged_dot("mxfp8", capacity=0)(x, w, jnp.array(SIZES, jnp.int32))
  np_small = run(np.int64(5))  # a NumPy integer is an int
  np.testing.assert_array_equal(np_small[0], small[0])


def test_one_key_or_one_per_expert():
  """A single key (here a raw uint32 one, of shape (2,) like 2 experts'
  typed keys) is split per expert; G keys are used as they are."""
  x, w, ct = _data(4)
  gs = jnp.array([9, 31], jnp.int32)

  def dx(key):
    f = lambda x: jnp.sum(ops.quantized_ragged_dot(  # noqa: E731
        x, w[:2], gs, "mxfp4", key=key)[0] * ct)
    return jax.jit(jax.grad(f))(x)

  key = jax.random.PRNGKey(5)  # raw: shape (2,), as 2 typed keys would be
  np.testing.assert_array_equal(dx(key), dx(jax.random.split(key, 2)))


def test_refusals():
  x, w, _ = _data()
  gs = jnp.array(SIZES, jnp.int32)
  with pytest.raises(ValueError, match="per-expert state; use "
                     "qlayers.QuantExperts"):
    ops.ragged_dot("fp8_delayed")
  with pytest.raises(ValueError, match=r"needs `state`, one amax history per "
                     "expert"):
    ops.quantized_ragged_dot(x, w, gs, "fp8_delayed")
  with pytest.raises(ValueError, match=r"keeps one per expert, \(3,\)"):
    ops.quantized_ragged_dot(x, w, gs, "fp8_delayed",
                             ops.init_state("fp8_delayed"))
  with pytest.raises(NotImplementedError, match="group_offset"):
    ops.ragged_dot("mxfp8")(x, w, gs, group_offset=jnp.array([0]))
  with pytest.raises(ValueError, match=r"lhs \[m, k\] and rhs \[g, k, n\]"):
    ops.ragged_dot("mxfp8")(x, w[0], gs)
  with pytest.raises(ValueError, match=r"group_sizes must be integers of "
                     r"shape \(3,\)"):
    ops.ragged_dot("mxfp8")(x, w, jnp.array([1.0, 2.0, 3.0]))
  # Negative sizes were clipped to 0 in silence (a bookkeeping bug's
  # output looked plausible).
  with pytest.raises(ValueError, match=r"must not be negative; got "
                     r"\[4, -1, 3\]"):
    ops.ragged_dot("fp8_current")(x, w, jnp.array([4, -1, 3]))
