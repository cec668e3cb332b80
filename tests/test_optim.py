"""qlayers.Optimizer and its optax pieces: hand-computed trajectories,
FP32 masters, moment dtypes, skipping, loss scaling, composition order and
sharded Params."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import ops
from qlayers import optim
from qlayers import scaling as S
from helpers import (DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure,
                     param_signature, train_step, weighted_sum)
from numerics import sqnr_db


class Vec(nnx.Module):

  def __init__(self, values, dtype=jnp.float32):
    self.w = nnx.Param(jnp.asarray(values, dtype))


def grads_of(model, values):
  return jax.tree.map(lambda p: jnp.asarray(values, p.dtype),
                      nnx.state(model, nnx.Param))


def test_sgd_momentum_trajectory():
  m = Vec([1.0, 2.0])
  opt = qlayers.Optimizer(m, optax.sgd(0.5, momentum=0.5))
  opt.update(m, grads_of(m, [1.0, -2.0]))
  # trace = g = [1, -2]; w = [1, 2] - 0.5 * [1, -2]
  np.testing.assert_array_equal(m.w[...], [0.5, 3.0])
  opt.update(m, grads_of(m, [2.0, 0.0]))
  # trace = [2, 0] + 0.5 * [1, -2] = [2.5, -1]; w -= 0.5 * trace
  np.testing.assert_array_equal(m.w[...], [-0.75, 3.5])
  assert int(opt.step[...]) == 2


@pytest.mark.usefixtures("optax_promotion")
def test_adam_first_steps_trajectory():
  m = Vec([1.0, -1.0])
  opt = qlayers.Optimizer(m, optax.adam(0.1, b1=0.5, b2=0.75, eps=0.0))
  opt.update(m, grads_of(m, [2.0, -4.0]))
  # Bias-corrected first step: m_hat = g, v_hat = g^2, update = -lr * sign(g).
  np.testing.assert_allclose(m.w[...], [0.9, -0.9], rtol=1e-6)
  opt.update(m, grads_of(m, [1.0, 4.0]))
  # mu = 0.5 * (0.5 * [2, -4]) + 0.5 * [1, 4] = [1, 1]
  # nu = 0.75 * (0.25 * [4, 16]) + 0.25 * [1, 16] = [1, 7]
  # bias corrections 1 - 0.5**2 = 0.75 and 1 - 0.75**2 = 0.4375.
  mu_hat = np.array([1.0, 1.0]) / 0.75
  nu_hat = np.array([1.0, 7.0]) / 0.4375
  want = np.array([0.9, -0.9]) - 0.1 * mu_hat / np.sqrt(nu_hat)
  np.testing.assert_allclose(m.w[...], want, rtol=1e-6)


def test_bf16_params_follow_fp32_masters():
  m = Vec([1.0, -3.0, 0.1], jnp.bfloat16)
  opt = qlayers.Optimizer(m, optax.sgd(1e-4))
  master = np.asarray(jnp.asarray([1.0, -3.0, 0.1], jnp.bfloat16), np.float32)
  g = np.array([1.0, -2.0, 0.5], np.float32)
  for _ in range(3):
    opt.update(m, grads_of(m, g))
    master = master - np.float32(1e-4) * g
    got = optim.find_state(opt.opt_state, optim.MasterWeightsState).master[
        "w"][...]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, master)
    assert m.w[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(m.w[...], got.astype(jnp.bfloat16))
  # 3e-4 in total on 1.0 is below bf16 resolution: only the master moved.
  assert float(m.w[...][0]) == 1.0 and master[0] != 1.0


@pytest.mark.usefixtures("optax_promotion")
def test_quant_state_bypasses_adam():
  r = delayed()
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe=r)
  opt = qlayers.Optimizer(m, optax.adam(1e-3))
  paths = pure(opt.opt_state)
  assert not any("quant" in p for p in paths)
  n_params = len(jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert not [p for p in paths if "/master/" in p]  # FP32 Params: no masters
  assert len([p for p in paths if "/mu/" in p]) == n_params
  assert not jax.tree.leaves(nnx.state(opt, qlayers.QuantVariable))

  # A gradient amax of 1e3 is written exactly (through p + u it would not be).
  c = jnp.full((2, 4), 1e3)
  _, grads = qlayers.value_and_grad(
      lambda m: weighted_sum(m(jnp.ones((2, 8))), c))(m)
  before = m.quant.read()
  g_amax = grads["quant"]["g_amax"][...]
  assert float(g_amax) == 1e3
  want = ops.update_scales(
      {"x": before["x"], "w": before["w"],
       "g": before["g"]._replace(amax=jnp.maximum(before["g"].amax, g_amax))})
  opt.update(m, grads)
  got = m.quant.read()
  for role in ops.ROLES:
    for a, b in zip(got[role], want[role]):
      assert a.dtype == jnp.float32 and np.array_equal(a, b), role
  assert float(got["g"].amax_history[0]) == 1e3


@pytest.mark.usefixtures("optax_promotion")
def test_nonfinite_step_changes_only_skipped():
  m = Vec([1.0, 2.0], jnp.bfloat16)
  opt = qlayers.Optimizer(m, optax.adam(0.1))
  opt.update(m, grads_of(m, [1.0, 1.0]))
  before_p, before_o = pure(nnx.state(m)), pure(opt.opt_state)
  opt.update(m, grads_of(m, [jnp.nan, 1.0]))
  after_p, after_o = pure(nnx.state(m)), pure(opt.opt_state)
  for k in before_p:
    assert np.array_equal(before_p[k], after_p[k]), k
  changed = [k for k in before_o if not np.array_equal(
      before_o[k], after_o[k], equal_nan=True)]
  assert changed == ["skipped"], changed
  assert int(opt.skipped_steps) == 1
  opt.update(m, grads_of(m, [jnp.inf, 1.0]))
  assert int(opt.skipped_steps) == 2
  assert np.array_equal(pure(nnx.state(m))["w"], before_p["w"])


@pytest.mark.parametrize("jit", [False, True])
def test_all_finite_finds_any_nonfinite_element(jit):
  check = jax.jit(optim.all_finite) if jit else optim.all_finite
  big = jnp.ones((3, 4097), jnp.float32)  # past the vectorized float max
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  clean = {"a": big.at[0, 0].set(np.finfo(np.float32).max),
           "b": jnp.full((5,), tiny, jnp.bfloat16),
           "c": jnp.array([-65504.0], jnp.float16),
           "d": jnp.array([448.0, -0.0], jnp.float8_e4m3fn),
           "e": jnp.zeros((0, 3)), "i": jnp.arange(4)}
  assert bool(check(clean))
  assert bool(check({})) and bool(check({"i": jnp.arange(3)}))
  bad = [("a", (2, 4096), jnp.nan), ("a", (1, 17), -jnp.inf),
         ("b", (4,), jnp.inf), ("c", (0,), jnp.nan), ("d", (1,), jnp.nan)]
  for leaf, index, value in bad:
    tree = dict(clean)
    tree[leaf] = tree[leaf].at[index].set(value)
    assert not bool(check(tree)), (leaf, index, value)


@pytest.mark.usefixtures("optax_promotion")
def test_new_optimizer_on_same_tx_reuses_compiled_step():
  tx = optax.adam(0.1)
  traces = []

  @nnx.jit
  def step(m, opt, g):
    traces.append(1)
    opt.update(m, grads_of(m, g))

  for _ in range(2):
    m = Vec([1.0, 2.0])
    opt = qlayers.Optimizer(m, tx)
    step(m, opt, jnp.array([1.0, -1.0]))
    assert float(m.w[...][0]) != 1.0
  assert len(traces) == 1
  # Different settings are a different wrapper (and a new trace).
  m = Vec([1.0, 2.0])
  step(m, qlayers.Optimizer(m, tx, moment_dtype=jnp.bfloat16),
       jnp.array([1.0, -1.0]))
  assert len(traces) == 2


@pytest.mark.usefixtures("optax_promotion")
def test_bf16_moments():
  runs = {}
  for dt in (jnp.float32, jnp.bfloat16):
    m = Vec([1.0, 2.0, 3.0])
    opt = qlayers.Optimizer(m, optax.adam(0.1), moment_dtype=dt)
    for g in ([1.0, -2.0, 0.3], [0.5, 1.0, -0.7]):
      opt.update(m, grads_of(m, g))
    adam = optim.find_state(opt.opt_state, optax.ScaleByAdamState)
    mu, nu = adam.mu, adam.nu
    assert mu["w"][...].dtype == dt and nu["w"][...].dtype == dt
    assert adam.count[...].dtype == jnp.int32
    runs[dt] = (np.asarray(mu["w"][...], np.float32), np.asarray(m.w[...]))
  (mu32, w32), (mu16, w16) = runs[jnp.float32], runs[jnp.bfloat16]
  np.testing.assert_allclose(mu16, mu32, rtol=1e-2)
  np.testing.assert_allclose(w16, w32, rtol=1e-2)


def test_dynamic_loss_scaling():
  m = Vec([1.0, 2.0])
  opt = qlayers.Optimizer(m, optax.sgd(1.0), loss_scaling="dynamic",
                          init_loss_scale=8.0, growth_interval=2)
  assert float(opt.loss_scale) == 8.0
  # Gradients arrive scaled by the loss scale and are unscaled here.
  opt.update(m, grads_of(m, [8.0 * 0.25, 8.0 * -0.5]))
  np.testing.assert_array_equal(m.w[...], [0.75, 2.5])
  assert float(opt.loss_scale) == 8.0
  opt.update(m, grads_of(m, [0.0, 0.0]))
  assert float(opt.loss_scale) == 16.0  # grown after 2 finite steps
  opt.update(m, grads_of(m, [jnp.inf, 0.0]))
  assert float(opt.loss_scale) == 8.0  # halved on overflow
  assert int(opt.skipped_steps) == 1
  np.testing.assert_array_equal(m.w[...], [0.75, 2.5])
  opt.update(m, grads_of(m, [0.0, 0.0]))
  assert float(opt.loss_scale) == 8.0  # the good-step count restarted
  opt.update(m, grads_of(m, [16.0, 0.0]))
  assert float(opt.loss_scale) == 16.0
  np.testing.assert_array_equal(m.w[...], [-1.25, 2.5])


# ==========================================================================
# The optax pieces alone, on plain arrays


def bits(x):
  """The bit patterns of ``x`` (so -0.0 != 0.0 and NaN == NaN)."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def assert_bits_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(bits(x), bits(y))


def test_master_weights_trajectory():
  tx = optim.master_weights(optax.sgd(1.0))
  p = {"a": jnp.ones(1, jnp.bfloat16), "b": jnp.ones(1)}
  s = tx.init(p)
  assert isinstance(s.master["b"], optax.MaskedNode)  # FP32: no master
  g = {"a": jnp.full(1, 2.0**-10, jnp.bfloat16), "b": jnp.full(1, 0.25)}
  # The master takes every 2^-10 step; BF16 (spacing 2^-8 below 1) only
  # moves once the master is nearer 1 - 2^-8 than 1. At 1 - 2^-9 (a tie)
  # round-to-nearest-even keeps 1.0.
  masters = [1 - 2.0**-10, 1 - 2.0**-9, 1 - 3 * 2.0**-10]
  narrow = [1.0, 1.0, 1 - 2.0**-8]
  for m_want, a_want in zip(masters, narrow):
    u, s = tx.update(g, s, p)
    assert s.master["a"].dtype == jnp.float32
    assert float(s.master["a"][0]) == m_want
    assert u["a"].dtype == jnp.bfloat16 and u["b"].dtype == jnp.float32
    assert float(u["b"][0]) == -0.25  # a wide Param's update passes through
    p = optax.apply_updates(p, u)
    assert float(p["a"][0]) == a_want
  # Plain BF16 SGD never leaves 1.0: 1 - 2^-10 rounds back up every step.
  assert float(optax.apply_updates(jnp.ones(1, jnp.bfloat16),
                                   -g["a"])[0]) == 1.0


def test_master_weights_needs_params_and_a_float_dtype():
  tx = optim.master_weights(optax.sgd(1.0))
  s = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, s)
  with pytest.raises(ValueError, match="master dtype must be a floating"):
    optim.master_weights(optax.sgd(1.0), dtype=jnp.int32)


def test_cast_moments_stores_narrow_computes_wide():
  tx = optim.cast_moments(optax.sgd(1.0, momentum=0.5), jnp.bfloat16)
  p = {"w": jnp.zeros(1)}
  s = tx.init(p)
  g1 = 1 + 2.0**-10  # exact in FP32, rounds to 1.0 in BF16
  u, s = tx.update({"w": jnp.full(1, g1)}, s, p)
  # This step's update uses the FP32 trace; only the stored one is narrow.
  assert float(u["w"][0]) == -g1
  trace = s.inner_state[0].trace["w"]
  assert trace.dtype == jnp.bfloat16 and float(trace[0]) == 1.0
  u, s = tx.update({"w": jnp.zeros(1)}, s, p)
  assert float(u["w"][0]) == -0.5  # 0.5 * the stored 1.0, not 0.5 * g1
  with pytest.raises(ValueError, match="moment dtype must be a floating"):
    optim.cast_moments(optax.sgd(1.0), "int8")


def test_cast_moments_leaves_scalars_alone():
  tx = optim.cast_moments(
      optax.inject_hyperparams(optax.adam)(learning_rate=0.1), jnp.bfloat16)
  s = tx.init({"w": jnp.ones(3)})
  inner = s.inner_state
  assert inner.hyperparams["learning_rate"].dtype == jnp.float32
  assert inner.inner_state[0].count.dtype == jnp.int32
  assert inner.inner_state[0].mu["w"].dtype == jnp.bfloat16


def test_skip_if_nonfinite_trajectory():
  tx = optim.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.array([-0.0, 0.0, 1.0])}
  s = tx.init(p)
  u, s = tx.update({"w": jnp.array([1.0, 2.0, 0.0])}, s, p)
  np.testing.assert_array_equal(u["w"], [-1.0, -2.0, -0.0])
  before = s
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    u, s = tx.update({"w": jnp.array([bad, 1.0, 1.0])}, s, p)
    assert np.all(np.signbit(u["w"])) and not np.any(u["w"])  # all -0.0
    # p + (-0.0) is p bit for bit, signed zeros included.
    assert_bits_equal(optax.apply_updates(p, u), p)
    assert_bits_equal(s.inner_state, before.inner_state)
  assert int(s.skipped) == 3
  u, s = tx.update({"w": jnp.array([1.0, 0.0, 0.0])}, s, p)
  # trace = g + 0.5 * trace = [1, 0, 0] + 0.5 * [1, 2, 0]
  np.testing.assert_array_equal(u["w"], [-1.5, -1.0, -0.0])
  assert int(s.skipped) == 3


def test_skip_if_nonfinite_jitted_matches_eager():
  tx = optim.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.ones(2)}
  gs = [jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 1.0]),
        jnp.array([0.5, 0.5])]
  out = {}
  for name, update in (("eager", tx.update), ("jit", jax.jit(tx.update))):
    s, us = tx.init(p), []
    for g in gs:
      u, s = update({"w": g}, s, p)
      us.append(u)
    out[name] = (us, s)
  assert_bits_equal(out["eager"], out["jit"])


def test_skip_if_nonfinite_names_a_state_that_changes_dtype():
  # BF16 Params, FP32 gradients and no masters: the momentum would turn FP32.
  tx = optim.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"changed its state .*trace.*"
                     r"bfloat16\[2\] to float32\[2\]"):
    tx.update({"w": jnp.ones(2)}, tx.init(p), p)


def _counting(inner):
  """``inner`` with a count of its update's calls (traces, under jit)."""
  calls = []

  def update(updates, state, params=None):
    calls.append(1)
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update), calls


@pytest.mark.parametrize("update_dtype", [jnp.float32, jnp.bfloat16])
def test_skip_if_nonfinite_traces_the_step_once(update_dtype):
  """Updates typed as the gradients: one trace of the inner update (the
  cond's, no separate shape pass); updates of another dtype still work
  (their types from a trace of the step)."""
  cast = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (jax.tree.map(lambda t: t.astype(update_dtype),
                                         u), s))
  inner, calls = _counting(optax.chain(optax.sgd(1.0, momentum=0.5), cast))
  tx = optim.skip_if_nonfinite(inner)
  p = {"w": jnp.ones(3)}
  s = tx.init(p)
  u, s = jax.jit(tx.update)({"w": jnp.array([1.0, 2.0, 3.0])}, s, p)
  if update_dtype == jnp.float32:
    assert len(calls) == 1
  assert u["w"].dtype == update_dtype
  np.testing.assert_array_equal(u["w"].astype(jnp.float32), [-1, -2, -3])
  u, s = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 3.0])}, s, p)
  assert u["w"].dtype == update_dtype and int(s.skipped) == 1
  assert np.all(np.signbit(u["w"].astype(jnp.float32)))


def test_dynamic_loss_scaling_trajectory():
  tx = optim.dynamic_loss_scaling(optax.sgd(1.0), init_scale=4.0,
                                  growth_interval=2)
  s = tx.init({"w": jnp.zeros(1)})
  steps = [  # (scaled gradient, update, scale after, good steps after)
      (8.0, -2.0, 4.0, 1),
      (4.0, -1.0, 8.0, 0),  # 2 finite steps in a row: grown
      (jnp.inf, -jnp.inf, 4.0, 0),  # alone it does not skip, only backs off
      (8.0, -2.0, 4.0, 1),
      (jnp.nan, None, 2.0, 0),
      (jnp.inf, None, 1.0, 0),
      (jnp.inf, None, 1.0, 0),  # never below 1
  ]
  for g, want_u, want_scale, want_good in steps:
    u, s = tx.update({"w": jnp.full(1, g)}, s)
    if want_u is not None:
      assert float(u["w"][0]) == want_u
    assert float(s.loss_scale) == want_scale
    assert int(s.good_steps) == want_good
    assert s.loss_scale.dtype == jnp.float32
    assert s.good_steps.dtype == jnp.int32


def test_dynamic_loss_scaling_unscales_fp16_in_fp32():
  tx = optim.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**20)
  g = jnp.full(1, 1 + 2.0**-10, jnp.float16)  # exact in FP16
  u, _ = tx.update({"w": g}, tx.init({"w": jnp.zeros(1, jnp.float16)}))
  # (1 + 2^-10) * 2^-20 is exact in FP32; FP16 (subnormal spacing 2^-24)
  # would round it to 2^-20.
  assert u["w"].dtype == jnp.float32
  assert float(u["w"][0]) == -(1 + 2.0**-10) * 2.0**-20


@pytest.mark.parametrize("kwargs, match", [
    ({"init_scale": 0.5}, "init_scale"),
    ({"init_scale": float("inf")}, "init_scale"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 1.5}, "growth_interval"),
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
])
def test_dynamic_loss_scaling_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optim.dynamic_loss_scaling(optax.sgd(1.0), **kwargs)


def test_mixed_precision_rejects_loss_scaling_without_skipping():
  with pytest.raises(ValueError, match="needs skip_nonfinite"):
    optim.mixed_precision(optax.sgd(1.0), dynamic_loss_scale=True,
                          skip_nonfinite=False)


# ==========================================================================
# Composition


def _chain(state):
  out = []
  while hasattr(state, "inner_state"):
    out.append(type(state).__name__)
    state = state.inner_state
  return out


def test_mixed_precision_composition_order():
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  full = optim.mixed_precision(optax.adam(0.1), moment_dtype=jnp.bfloat16,
                               dynamic_loss_scale=True)
  assert _chain(full.init(p)) == ["LossScaleState", "SkipState",
                                  "MasterWeightsState", "CastMomentsState"]
  assert _chain(optim.mixed_precision(optax.adam(0.1)).init(p)) == [
      "SkipState", "MasterWeightsState"]
  assert _chain(optim.mixed_precision(
      optax.adam(0.1), master_dtype=None, skip_nonfinite=False).init(p)) == []


@pytest.mark.usefixtures("optax_promotion")
def test_masters_outside_moment_cast_stay_wide():
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  good = optim.master_weights(optim.cast_moments(optax.adam(0.1),
                                                 jnp.bfloat16))
  bad = optim.cast_moments(optim.master_weights(optax.adam(0.1)),
                           jnp.bfloat16)
  s_good, s_bad = good.init(p), bad.init(p)
  assert s_good.master["w"].dtype == jnp.float32
  assert s_good.inner_state.inner_state[0].mu["w"].dtype == jnp.bfloat16
  # The other way round the cast reaches the masters too.
  assert s_bad.inner_state.master["w"].dtype == jnp.bfloat16


def test_loss_scale_outside_skipping_backs_off_on_overflow():
  p = {"w": jnp.ones(1)}
  g = {"w": jnp.full(1, jnp.inf)}
  tx = optim.mixed_precision(optax.sgd(1.0), dynamic_loss_scale=True,
                             init_loss_scale=8.0)
  u, s = tx.update(g, tx.init(p), p)
  assert float(s.loss_scale) == 4.0 and int(s.inner_state.skipped) == 1
  assert not np.any(u["w"])
  # Skipping outside the loss scale would freeze the scale with the rest.
  swapped = optim.skip_if_nonfinite(optim.dynamic_loss_scaling(
      optax.sgd(1.0), init_scale=8.0))
  _, s = swapped.update(g, swapped.init(p), p)
  assert float(s.inner_state.loss_scale) == 8.0 and int(s.skipped) == 1


# ==========================================================================
# Optimizer


def test_fp32_params_hold_no_masters_and_match_nnx_optimizer():
  def train(make):
    m = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    opt = make(m, optax.sgd(0.1, momentum=0.9))
    for i in range(3):
      grads = nnx.grad(lambda m: jnp.sum(m(jnp.full((2, 4), i + 1.0)) ** 2))(m)
      opt.update(m, grads)
    return pure(nnx.state(m)), opt

  stock, _ = train(lambda m, tx: nnx.Optimizer(m, tx, wrt=nnx.Param))
  plain, _ = train(lambda m, tx: qlayers.Optimizer(m, tx,
                                                   skip_nonfinite=False))
  assert_bits_equal(stock, plain)  # the same ops: the same bits
  # Inside the skip's lax.cond the update is one compiled computation,
  # which may round a multiply-add differently (by an ulp).
  got, opt = train(qlayers.Optimizer)
  for k in stock:
    np.testing.assert_allclose(got[k], stock[k], rtol=1e-6, atol=0, err_msg=k)
  # Nothing narrow: no master_weights in the composition at all.
  assert optim.find_state(opt.opt_state, optim.MasterWeightsState) is None
  assert not [k for k in pure(opt.opt_state) if "master" in k]


@pytest.mark.usefixtures("optax_promotion")
def test_nonfinite_step_with_everything_on_is_bit_exact():
  m = Vec([1.0, -0.0, 3.0], jnp.bfloat16)
  m.b = nnx.Param(jnp.array([-0.0, 0.5]))  # wide, with a signed zero
  opt = qlayers.Optimizer(m, optax.adam(0.1), moment_dtype=jnp.bfloat16,
                          loss_scaling="dynamic", init_loss_scale=4.0)
  def grads(w, b):
    return nnx.State({"w": nnx.Param(jnp.asarray(w, jnp.bfloat16)),
                      "b": nnx.Param(jnp.asarray(b, jnp.float32))})
  opt.update(m, grads([4.0, 4.0, -4.0], [0.0, 4.0]))
  before_p, before_o = pure(nnx.state(m)), pure(opt.opt_state)
  opt.update(m, grads([1.0, 1.0, 1.0], [jnp.nan, 0.0]))
  after_p, after_o = pure(nnx.state(m)), pure(opt.opt_state)
  for k in before_p:
    np.testing.assert_array_equal(bits(before_p[k]), bits(after_p[k]), k)
  changed = sorted(k for k in before_o
                   if not np.array_equal(bits(before_o[k]), bits(after_o[k])))
  assert changed == ["good_steps", "inner_state/skipped", "loss_scale"]
  assert int(opt.skipped_steps) == 1 and float(opt.loss_scale) == 2.0
  assert np.signbit(after_p["b"][0])


def test_properties_without_the_pieces():
  m = Vec([1.0, 2.0])
  opt = qlayers.Optimizer(m, optax.sgd(0.5), skip_nonfinite=False)
  assert int(opt.skipped_steps) == 0 and float(opt.loss_scale) == 1.0
  opt.update(m, grads_of(m, [1.0, 1.0]))
  np.testing.assert_array_equal(m.w[...], [0.5, 1.5])


def test_jitted_bf16_step_writes_params_from_masters():
  m = Vec([1.0, 1.0], jnp.bfloat16)
  opt = qlayers.Optimizer(m, optax.sgd(1.0))

  @nnx.jit
  def step(m, opt):
    opt.update(m, grads_of(m, [2.0**-10, 2.0**-10]))

  for _ in range(3):
    step(m, opt)
  master = optim.find_state(opt.opt_state, optim.MasterWeightsState).master
  assert float(master["w"][...][0]) == 1 - 3 * 2.0**-10
  assert float(m.w[...][0]) == 1 - 2.0**-8


# ==========================================================================
# Sharded Params (8 simulated CPU devices, in a fresh process)


def run_with_devices(snippet: str, devices: int = 8, timeout: float = 600):
  """Runs ``snippet`` in a new interpreter with ``devices`` CPU devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices}")
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(snippet)],
                        env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, PartitionSpec as P
from flax import nnx
import qlayers
from qlayers import optim

jax.config.update("jax_numpy_dtype_promotion", "strict")
assert jax.device_count() == 8


class Net(nnx.Module):
  def __init__(self, dtype, rngs):
    shard = lambda init, axes: nnx.with_partitioning(init, axes)
    self.gain = nnx.Param(jnp.ones(16, dtype))  # unsharded
    self.up = nnx.Linear(
        16, 32, param_dtype=dtype, rngs=rngs,
        kernel_init=shard(nnx.initializers.lecun_normal(), (None, "model")),
        bias_init=shard(nnx.initializers.zeros_init(), ("model",)))

  def __call__(self, x):
    return self.up(x * self.gain[...])


def axes(spec):  # a PartitionSpec without trailing Nones: P(None,) == P()
  spec = tuple(spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


for axis_type in (AxisType.Auto, AxisType.Explicit):
  for dtype in (jnp.float32, jnp.bfloat16):
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
      m = Net(dtype, nnx.Rngs(0))
      opt = qlayers.Optimizer(m, optax.adam(1e-2), moment_dtype=jnp.float32,
                              loss_scaling="dynamic", init_loss_scale=2.0)
      x = jnp.ones((8, 16), dtype)

      @nnx.jit
      def step(m, opt, x):
        loss_fn = lambda m: jnp.mean((m(x).astype(jnp.float32) - 1.0) ** 2)
        loss, g = nnx.value_and_grad(loss_fn)(m)
        g = jax.tree.map(lambda a: a * jnp.asarray(2.0, a.dtype), g)
        opt.update(m, g)
        return loss

      losses = [float(step(m, opt, x)) for _ in range(3)]
      assert losses[2] < losses[0], losses
      assert int(opt.skipped_steps) == 0 and int(opt.step[...]) == 3
      params = nnx.state(m, nnx.Param)
      want = {"up/kernel": P(None, "model"), "up/bias": P("model"),
              "gain": P()}
      pflat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
      got = {k: axes(v.get_value().sharding.spec) for k, v in pflat.items()}
      assert got == {k: axes(v) for k, v in want.items()}, got
      adam = optim.find_state(opt.opt_state, optax.ScaleByAdamState)
      mw = optim.find_state(opt.opt_state, optim.MasterWeightsState)
      trees = {"mu": adam.mu, "nu": adam.nu}
      if dtype == jnp.bfloat16:
        trees["master"] = mw.master
      else:
        assert mw is None
      for name, tree in trees.items():
        flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(tree)}
        assert flat.keys() == got.keys(), (name, flat.keys())
        for k, v in flat.items():
          assert axes(v.get_value().sharding.spec) == got[k], (name, k)
          assert v.get_value().dtype == jnp.float32, (name, k)
          assert v.get_metadata().get("out_sharding") == \
              pflat[k].get_metadata().get("out_sharding"), (name, k)
      if dtype == jnp.bfloat16:
        for k, v in nnx.to_flat_state(mw.master):
          np.testing.assert_array_equal(
              v.get_value().astype(dtype),
              pflat["/".join(map(str, k))].get_value())
      print("ok", axis_type, jnp.dtype(dtype).name, losses)
"""


def test_optimizer_under_auto_and_explicit_meshes():
  out = run_with_devices(_SHARDED)
  assert out.count("ok ") == 4, out
