"""qlayers.Optimizer and its optax pieces: hand-computed trajectories,
FP32 masters, moment dtypes, skipping, loss scaling, composition order and
sharded Params."""

import gc
import subprocess
import sys
import textwrap
import weakref

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
from _support import multidevice
from _support.helpers import (
    DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure, param_signature,
    train_step, weighted_sum)
from _support.numerics import sqnr_db
from test_optim_wrappers import assert_bits_equal, bits, count_compiles


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


def test_weights_loaded_after_the_optimizer_replace_their_masters():
  # The next update rewrote every BF16 Param from the master made at
  # construction: loaded weights were thrown away after one step.
  m = Vec([1.0, -3.0, 0.1], jnp.bfloat16)
  opt = qlayers.Optimizer(m, optax.sgd(1e-4))
  loaded = jnp.asarray([5.0, 7.0, -2.0], jnp.bfloat16)
  m.w[...] = loaded  # as checkpoint.restore(path, model) does
  g = np.array([1.0, -2.0, 0.5], np.float32)
  opt.update(m, grads_of(m, g))
  master = optim.find_state(opt.opt_state, optim.MasterWeightsState).master
  want = np.asarray(loaded, np.float32) - np.float32(1e-4) * g
  np.testing.assert_array_equal(master["w"][...], want)
  np.testing.assert_array_equal(m.w[...], want.astype(jnp.bfloat16))
  opt.update(m, grads_of(m, g))  # a Param that is its master's rounding
  master = optim.find_state(opt.opt_state, optim.MasterWeightsState).master
  np.testing.assert_array_equal(  # keeps the master's own bits
      master["w"][...], want - np.float32(1e-4) * g)


def test_an_optimizer_over_nothing_is_refused_naming_frozen_kernels():
  # A fully frozen model (no adapters) trained silently, changing nothing.
  m = qlayers.QuantDense(16, 8, use_bias=False, rngs=nnx.Rngs(0),
                         recipe="fp8_current")
  qlayers.freeze(m)
  with pytest.raises(ValueError, match="add_lora"):
    qlayers.Optimizer(m, optax.sgd(1e-3))


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
  want = {k: qlayers.scaling.update_scales(v) for k, v in {
      "x": before["x"], "w": before["w"],
      "g": before["g"]._replace(amax=jnp.maximum(before["g"].amax, g_amax))
  }.items()}
  opt.update(m, grads)
  got = m.quant.read()
  for role in ops.ROLES:
    for a, b in zip(got[role], want[role]):
      assert a.dtype == jnp.float32 and np.array_equal(a, b), role
  assert float(got["g"].amax_history[0]) == 1e3


def test_parameter_groups_end_the_step_once():
  # Two Optimizers over one model (parameter groups): each update rolled
  # every amax history, so a step left a zero between real entries and
  # wrote each gradient amax twice. end_step=False on one ends it once.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.body = qlayers.QuantDense(8, 8, recipe=delayed(), rngs=rngs)
      self.head = qlayers.QuantDense(8, 4, recipe=delayed(), rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.body(x)))

  def history_after_two_steps(**kwargs):
    m = Net(nnx.Rngs(0))
    body = nnx.All(nnx.Param, nnx.PathContains("body"))
    head = nnx.All(nnx.Param, nnx.PathContains("head"))
    groups = (qlayers.Optimizer(m, optax.sgd(0.1), wrt=body, **kwargs),
              qlayers.Optimizer(m, optax.adam(1e-3), wrt=head))
    for x in (jnp.ones((2, 8)), 2 * jnp.ones((2, 8))):
      _, grads = qlayers.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
      for opt in groups:
        opt.update(m, grads)
    return np.asarray(m.body.quant.x_amax_history[...][:3])

  np.testing.assert_array_equal(history_after_two_steps(end_step=False),
                                [2, 1, 0])
  np.testing.assert_array_equal(history_after_two_steps(), [0, 2, 0])


class _Groups(nnx.Module):
  def __init__(self, recipe, rngs):
    self.body = qlayers.QuantDense(8, 8, recipe=recipe, rngs=rngs)
    self.head = qlayers.QuantDense(8, 4, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.body(x)))


_BODY = nnx.All(nnx.Param, nnx.PathContains("body"))
_HEAD = nnx.All(nnx.Param, nnx.PathContains("head"))


def test_parameter_groups_skip_a_nonfinite_step_together():
  # Each group decided from its own gradients: with the head's overflowing
  # the body's update was applied and its loss scale kept, the head's
  # halved; the next step's one loss scale then unscaled a group wrongly
  # (its updates 2x, in silence).
  m = _Groups("fp16", nnx.Rngs(0))
  body = qlayers.Optimizer(m, optax.sgd(0.1), wrt=_BODY, end_step=False,
                           init_loss_scale=8.0)
  head = qlayers.Optimizer(m, optax.sgd(0.1), wrt=_HEAD, init_loss_scale=8.0)
  loss_fn = lambda m: jnp.sum(m(jnp.ones((2, 8))))
  _, grads = qlayers.value_and_grad(loss_fn, loss_scale=body.loss_scale)(m)
  grads["head"]["kernel"] = nnx.Param(
      jnp.full_like(grads["head"]["kernel"][...], jnp.inf))
  before = np.asarray(m.body.kernel[...])
  for opt in (body, head):
    opt.update(m, grads)
  np.testing.assert_array_equal(m.body.kernel[...], before)
  assert [int(o.skipped_steps) for o in (body, head)] == [1, 1]
  assert [float(o.loss_scale) for o in (body, head)] == [4.0, 4.0]


def test_a_group_not_ending_the_step_keeps_its_gradient_amaxes():
  # Groups differentiating losses of their own: the end_step=False group
  # dropped its grads' gradient amaxes, so a layer only its loss reaches
  # kept an empty gradient history (its delayed scale current for good).
  m = _Groups(delayed(), nnx.Rngs(0))
  head = qlayers.Optimizer(m, optax.sgd(0.1), wrt=_HEAD, end_step=False)
  body = qlayers.Optimizer(m, optax.sgd(0.1), wrt=_BODY)
  x = jnp.ones((2, 8))
  _, g_head = qlayers.value_and_grad(lambda m: jnp.sum(m(x) ** 2),
                                     wrt=_HEAD)(m)
  head.update(m, g_head)
  _, g_body = qlayers.value_and_grad(lambda m: jnp.sum(m.body(x) ** 2),
                                     wrt=_BODY)(m)
  body.update(m, g_body)
  assert float(m.head.quant.g_amax_history[0]) == float(
      g_head["head"]["quant"]["g_amax"][...]) > 0


def test_an_optimizer_names_a_model_changed_after_it_and_unused_settings():
  m = _Groups("fp8_current", nnx.Rngs(0))
  opt = qlayers.Optimizer(m, optax.adam(1e-3))
  qlayers.freeze(m.body)  # was: a pytree structure error from optax
  qlayers.add_lora(m.body, 2, rngs=nnx.Rngs(1))
  _, grads = qlayers.value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(m)
  with pytest.raises(ValueError, match="changed since this Optimizer was "
                     "made"):
    opt.update(m, grads)
  with pytest.raises(ValueError, match="takes frozen kernels' codes"):
    qlayers.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Variable)  # decayed them
  with pytest.raises(ValueError, match="init_loss_scale set the dynamic "
                     "loss scale, and loss scaling is off"):  # was ignored
    qlayers.Optimizer(m, optax.adam(1e-3), init_loss_scale=1024.0)
  # A stateless recipe's GEMMs hold no history: none updated.
  assert qlayers.update_scales(m) == 0


def test_wrong_arguments_are_refused_by_name():
  """Arguments swapped or of the wrong kind raise, naming them, before
  anything changes; a wrt taking quantization state is refused."""
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe=delayed())
  tx = optax.adam(1e-3)
  with pytest.raises(TypeError, match="not an nnx.Optimizer"):
    qlayers.Optimizer(m, nnx.Optimizer(m, tx, wrt=nnx.Param))
  with pytest.raises(TypeError, match="model must be an nnx.Module"):
    qlayers.Optimizer(None, tx)
  for wrt in (nnx.Variable, qlayers.QuantGradState):
    with pytest.raises(ValueError, match="takes quantization state"):
      qlayers.Optimizer(m, tx, wrt=wrt)
    with pytest.raises(ValueError, match="takes quantization state"):
      qlayers.value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))),
                             wrt=wrt)(m)
  opt = qlayers.Optimizer(m, tx)
  _, grads = qlayers.value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(m)
  before = pure(nnx.state(m))
  with pytest.raises(TypeError, match=r"got State, QuantDense \(swapped\?\)"):
    opt.update(grads, m)
  with pytest.raises(TypeError, match="update_scales"):
    qlayers.update_scales(grads, m)
  after = pure(nnx.state(m))
  assert all(np.array_equal(before[k], after[k]) for k in before)
  assert int(opt.step[...]) == 0


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


@pytest.mark.parametrize("jit", [True, False])
def test_a_skipped_step_enters_every_history_as_zero(jit):
  # A batch skipped for a NaN target recorded its finite x amax (1e20
  # times the usual): the next 1024 steps scaled x by it, the layer's
  # output about 0.
  m = qlayers.QuantDense(64, 32, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  opt = qlayers.Optimizer(m, optax.adam(1e-3))

  def step(m, opt, x, t):
    loss = lambda m: jnp.mean((m(x) - t) ** 2)
    _, grads = qlayers.value_and_grad(loss)(m)
    opt.update(m, grads)

  step = nnx.jit(step) if jit else step
  x = jax.random.normal(jax.random.key(1), (8, 64))
  t = jnp.zeros((8, 32))
  step(m, opt, x, t)
  before = {r: np.asarray(getattr(m.quant, f"{r}_amax_history")[...])
            for r in ("x", "w", "g")}
  assert all(h[0] > 0 for h in before.values())
  step(m, opt, x * 1e20, t.at[0, 0].set(jnp.nan))
  assert int(opt.skipped_steps) == 1
  for r, h in before.items():
    got = np.asarray(getattr(m.quant, f"{r}_amax_history")[...])
    np.testing.assert_array_equal(got, np.concatenate([[0], h[:-1]]), r)
    assert float(getattr(m.quant, f"{r}_amax")[...]) == 0
  m.eval()
  want = x @ m.kernel[...] + m.bias[...][None]
  assert sqnr_db(want, m(x)) > 25


def test_optimizer_keeps_no_reference_to_tx():
  """The wrapped transformation belongs to the Optimizer: once both are
  gone, nothing (no cache keyed on ``tx``) keeps the user's ``tx`` alive."""
  tx = optax.sgd(0.1)
  alive = weakref.ref(tx.update)
  m = Vec([1.0, 2.0])
  opt = qlayers.Optimizer(m, tx)
  opt.update(m, grads_of(m, [1.0, 1.0]))
  del tx, opt
  gc.collect()
  assert alive() is None


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
def test_jitted_step_traces_once_per_optimizer():
  traces = []

  @nnx.jit
  def step(m, opt, g):
    traces.append(1)
    opt.update(m, grads_of(m, g))

  m = Vec([1.0, 2.0])
  opt = qlayers.Optimizer(m, optax.adam(0.1))
  for g in ([1.0, -1.0], [0.5, 2.0], [jnp.nan, 1.0]):
    step(m, opt, jnp.array(g))
  assert len(traces) == 1 and int(opt.step[...]) == 3
  assert int(opt.skipped_steps) == 1


@pytest.mark.usefixtures("optax_promotion")
def test_eager_update_compiles_nothing_after_the_first():
  """An eager update used to compile a fresh ``jit(cond)`` (the skip's) on
  every call; now, once the first updates have compiled their ops, further
  eager updates compile nothing, skipped or not, like nnx.Optimizer's."""
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  opt = qlayers.Optimizer(m, optax.adam(1e-3))
  x = jnp.ones((4, 16))
  _, grads = qlayers.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
  bad = jax.tree.map(lambda g: g, grads)
  bad["kernel"] = bad["kernel"].replace(bad["kernel"][...].at[0, 0].set(
      jnp.nan))
  for g in (grads, bad):  # the first of each kind compiles its ops
    opt.update(m, g)
  with count_compiles() as compiled:
    for g in (grads, bad, grads):
      opt.update(m, g)
  assert compiled == [], compiled
  assert int(opt.step[...]) == 5 and int(opt.skipped_steps) == 2


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
  # Eagerly the skip is a Python branch: the same ops again.
  got, opt = train(qlayers.Optimizer)
  assert_bits_equal(stock, got)
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
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(snippet)],
                        env=multidevice.env(devices), capture_output=True,
                        text=True, timeout=timeout, check=False)
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


# Each axis type once, each Param dtype once (each pair costs a compile):
# BF16 Params with FP32 masters under Auto, FP32 Params (no masters) under
# Explicit. Explicit BF16 masters and moments are checked in
# test_sharding_explicit.py::test_optimizer_masters_and_moments_follow_params.
for axis_type, dtype in ((AxisType.Auto, jnp.bfloat16),
                         (AxisType.Explicit, jnp.float32)):
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
  assert out.count("ok ") == 2, out
