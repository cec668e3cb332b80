"""qlayers.Optimizer and mixed_precision: hand-computed trajectories,
FP32 masters, moment dtypes, skipping and loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import ops
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
    got = opt.opt_state.master["w"][...]
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
  assert len([p for p in paths if p.startswith("master")]) == n_params
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
    mu, nu = opt.opt_state.inner_state[0].mu, opt.opt_state.inner_state[0].nu
    assert mu["w"][...].dtype == dt and nu["w"][...].dtype == dt
    assert opt.opt_state.inner_state[0].count[...].dtype == jnp.int32
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
