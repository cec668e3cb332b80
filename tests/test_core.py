"""QuantGemm, the core of every layer: NNX transforms, delayed-scaling
state flow, and a real training loop."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import ops
from qlayers import scaling as S
from _support.helpers import (
    DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure, param_signature,
    train_step, weighted_sum)
from _support.numerics import sqnr_db


def test_dense_jit_matches_eager():
  a = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  b = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  x = jax.random.normal(jax.random.key(0), (4, 16))
  ya = a(x)
  yb = nnx.jit(lambda m, x: m(x))(b, x)
  assert np.array_equal(ya, yb)
  sa, sb = pure(nnx.state(a)), pure(nnx.state(b))
  for k in sa:
    assert np.array_equal(sa[k], sb[k]), k
  assert float(b.quant.x_amax[...]) == float(jnp.max(jnp.abs(x)))


L_STACK = 3


class Stack(nnx.Module):
  """``L_STACK`` QuantDense layers made with nnx.vmap, applied by nnx.scan."""

  def __init__(self, recipe, rngs):
    @nnx.split_rngs(splits=L_STACK)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return qlayers.QuantDense(8, 8, recipe=recipe, rngs=rngs)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return jnp.tanh(layer(x))
    return body(self.layers, x)


def test_scan_stack_state_per_layer():
  r = delayed()
  model = Stack(r, nnx.Rngs(0))
  sc = model.layers.quant
  assert sc.x_amax[...].shape == (L_STACK,)
  assert sc.g_amax_history[...].shape == (L_STACK, 4)
  opt = qlayers.Optimizer(model, optax.sgd(0.1))
  step = train_step(lambda m, x: jnp.mean(m(x) ** 2))
  hist = []
  for i in range(3):
    step(model, opt, jax.random.normal(jax.random.key(i), (4, 8)))
    hist.append({role: np.asarray(getattr(sc, f"{role}_amax_history")[...])
                 for role in ops.ROLES})
  for role in ops.ROLES:
    h = hist[-1][role]
    assert np.all(h[:, :3] > 0) and np.all(h[:, 3] == 0), role
    # Each layer's row rolls by itself...
    for t in (1, 2):
      assert np.array_equal(hist[t][role][:, 1:], hist[t - 1][role][:, :-1])
      assert np.all(hist[t][role][:, 0] != hist[t - 1][role][:, 0])
    # ... and holds its own values.
    assert len(set(h[:, 0].tolist())) == L_STACK, role
    assert np.all(getattr(sc, f"{role}_amax")[...] == 0)

  # The scanned stack computes what the layers compute one after another.
  x = jax.random.normal(jax.random.key(9), (4, 8))
  layers = []
  for l in range(L_STACK):
    one = qlayers.QuantDense(8, 8, recipe=r, rngs=nnx.Rngs(0))
    nnx.update(one, jax.tree.map(lambda a, l=l: a[l],
                                 nnx.state(model.layers)))
    layers.append(one)
  @nnx.jit
  def one_by_one(layers, y):
    for one in layers:
      y = jnp.tanh(one(y))
    return y
  y = one_by_one(layers, x)
  assert np.allclose(nnx.jit(lambda m, x: m(x))(model, x), y, rtol=1e-6,
                     atol=1e-6)
  for l, one in enumerate(layers):
    np.testing.assert_allclose(one.quant.x_amax[...], sc.x_amax[...][l],
                               rtol=1e-6)


def test_remat_matches_plain():
  c = jnp.linspace(-2.0, 3.0, 4 * 8).reshape(4, 8)
  x = jax.random.normal(jax.random.key(0), (4, 16))

  def plain(m, x):
    return weighted_sum(m(x), c)

  def remat(m, x):
    return weighted_sum(nnx.remat(lambda m, x: m(x))(m, x), c)

  outs = []
  for f in (plain, remat):
    m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
    loss, grads = qlayers.value_and_grad(f)(m, x)
    outs.append((loss, pure(grads), pure(nnx.state(m))))
  (l0, g0, s0), (l1, g1, s1) = outs
  assert np.array_equal(l0, l1)
  assert g0.keys() == g1.keys() and s0.keys() == s1.keys()
  for k in g0:
    assert np.allclose(g0[k], g1[k], rtol=1e-6, atol=0), k
  assert g1["quant/g_amax"] == 3.0  # max |c|
  for k in s0:
    assert np.array_equal(s0[k], s1[k]), k


@pytest.mark.parametrize("mode", ["remat", "eval"])
def test_reused_layer_combines_by_max_under_remat_and_in_eval_mode(mode):
  """Two uses with gradient amaxes 3 and 5 give 5 (not 8) under nnx.remat,
  and in eval mode, whose state keeps its values bit for bit."""
  x = jax.random.normal(jax.random.key(0), (4, 16))
  c3 = jnp.full((4, 8), 0.5).at[0, 0].set(-3.0)
  c5 = jnp.full((4, 8), 0.25).at[1, 2].set(5.0)
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  call = nnx.remat(lambda m, x: m(x)) if mode == "remat" else (
      lambda m, x: m(x))
  if mode == "eval":
    m.eval()
  before = pure(nnx.state(m, qlayers.QuantVariable))
  _, grads = qlayers.value_and_grad(
      lambda m: weighted_sum(call(m, x), c3) + weighted_sum(call(m, x), c5))(m)
  assert float(grads["quant"]["g_amax"][...]) == 5.0
  after = pure(nnx.state(m, qlayers.QuantVariable))
  if mode == "eval":
    for k in before:
      assert np.array_equal(before[k], after[k]), k
  else:
    assert after["quant/x_amax"] == float(jnp.max(jnp.abs(x)))


class MLP(nnx.Module):

  def __init__(self, recipe, rngs):
    self.l1 = qlayers.QuantDense(16, 32, recipe=recipe, rngs=rngs)
    self.l2 = qlayers.QuantDense(32, 32, recipe=recipe, rngs=rngs)
    self.l3 = qlayers.QuantDense(32, 4, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.l3(nnx.gelu(self.l2(nnx.gelu(self.l1(x)))))


def test_training_fp8_delayed_moves_state_and_loss():
  model = MLP(delayed(history_len=32), nnx.Rngs(0))
  opt = qlayers.Optimizer(model, optax.adam(1e-2))
  teacher = jax.random.normal(jax.random.key(1), (16, 4))
  step = train_step(
      lambda m, x, y: jnp.mean((m(x) - y) ** 2))
  keys = jax.random.split(jax.random.key(2), 20)
  losses, hists = [], []
  for key in keys:
    x = jax.random.normal(key, (32, 16))
    losses.append(float(step(model, opt, x, jnp.tanh(x @ teacher))))
    hists.append({k: v for k, v in pure(nnx.state(model, qlayers.state.QuantState))
                  .items() if k.endswith("amax_history")})
  assert len(hists[0]) == 9  # x, w, g of three layers
  for t in range(1, len(hists)):
    for name, h in hists[t].items():
      prev = hists[t - 1][name]
      assert h[0] > 0 and h[0] != prev[0], (t, name)
      assert np.array_equal(h[1:t + 1], prev[:t]), (t, name)
  # Measured here: 0.86 at step 0, a mean of 0.37 over the last 5 steps.
  assert np.mean(losses[-5:]) < 0.6 * losses[0], losses


# ----------------------------------------------------------------------------
# Train and eval modes


def test_eval_mode_uses_stored_scales_and_writes_nothing():
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  x = jax.random.normal(jax.random.key(0), (4, 16))
  m(x)
  qlayers.update_scales(m)  # history [amax(x), 0, 0, 0]
  before = pure(nnx.state(m, qlayers.QuantVariable))
  m.eval()
  assert m.quant.use_running_average
  big = 100.0 * x
  y_eval = nnx.jit(lambda m, x: m(x))(m, big)
  # Nothing written, and the stored scale (from amax(x)) saturates `big`.
  after = pure(nnx.state(m, qlayers.QuantVariable))
  assert before.keys() == after.keys()
  for k in before:
    assert np.array_equal(before[k], after[k]), k
  assert sqnr_db(big @ m.kernel[...], y_eval - m.bias[...][None]) < 10
  m.train()
  assert not m.quant.use_running_average
  m(big)
  assert float(m.quant.x_amax[...]) == float(jnp.max(jnp.abs(big)))


def test_eval_mode_before_any_step_scales_by_the_current_amax():
  """A fresh model (empty history) evaluates with the current amax, not a
  scale of 1, and still writes nothing."""
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  x = 1e-3 * jax.random.normal(jax.random.key(0), (4, 16))
  ref = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  v = nnx.view(m, use_running_average=True)
  assert sqnr_db(ref(x), v(x)) > 20
  assert float(m.quant.x_amax[...]) == 0.0


# ----------------------------------------------------------------------------
# The stock NNX training loop


def test_stock_nnx_loop_with_update_scales_matches_qlayers_loop():
  """nnx.value_and_grad over (Param, QuantGradState) + nnx.Optimizer +
  qlayers.update_scales moves every history as the qlayers loop does."""
  x = jax.random.normal(jax.random.key(0), (4, 16))
  c = jnp.linspace(-2.0, 3.0, 4 * 8).reshape(4, 8)
  loss_fn = lambda m, x: weighted_sum(m(x), c)
  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))

  @nnx.jit
  def stock_step(m, opt, x):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(m, x)
    opt.update(m, grads)
    qlayers.update_scales(m, grads)
    return loss

  a = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  b = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  opt_a = nnx.Optimizer(a, optax.sgd(0.1), wrt=nnx.Param)
  opt_b = qlayers.Optimizer(b, optax.sgd(0.1))
  q_step = train_step(loss_fn)
  for i in range(3):
    xi = x * (i + 1)
    la, lb = stock_step(a, opt_a, xi), q_step(b, opt_b, xi)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
  sa = pure(nnx.state(a, qlayers.QuantVariable))
  sb = pure(nnx.state(b, qlayers.QuantVariable))
  for k in sa:
    np.testing.assert_allclose(sa[k], sb[k], rtol=1e-6, err_msg=k)
  assert np.all(sa["quant/g_amax_history"][:3] == 3.0)  # max |c|


def test_differentiating_without_the_gradient_amax_warns_per_trace():
  """Every trace of a layer differentiated without its gradient amax warns
  (Python's filters decide how often it is shown), not once per process."""
  x = jnp.ones((4, 16))
  for _ in range(2):
    m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
    with pytest.warns(UserWarning, match="qlayers.update_scales"):
      nnx.grad(lambda m: m(x).sum())(m)


def _stock_steps(m, ended: bool, steps: int = 2):
  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
  opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
  for _ in range(steps):
    _, grads = nnx.value_and_grad(lambda m: jnp.mean(m(jnp.ones((2, 8))) ** 2),
                                  argnums=diff)(m)
    opt.update(m, grads)
    if ended:
      qlayers.update_scales(m, grads)


def test_eval_warns_when_no_training_step_was_ended():
  """DiffState without qlayers.update_scales leaves every history at 0:
  model.eval() says so; after a loop that ends its steps it is silent."""
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe=delayed())
  _stock_steps(m, ended=False)
  assert float(jnp.abs(m.quant.g_amax_history[...]).sum()) == 0.0
  with pytest.warns(UserWarning, match="no training step was ended"):
    m.eval()
  ok = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe=delayed())
  _stock_steps(ok, ended=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ok.eval()
  assert ok.quant.use_running_average


def test_eval_of_an_abstract_delayed_model():
  """model.eval() on a model of shapes (nnx.eval_shape, the sharded init's
  first step) switches mode without reading values (was a TypeError)."""
  m = nnx.eval_shape(lambda: qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0),
                                                recipe=delayed()))
  m.eval()
  assert m.quant.use_running_average


def test_stock_linear_with_quant_gemm_refuses_a_scalar_like_lax():
  """A stock nnx.Linear running QuantGemm as its dot_general gives the
  TypeError lax.dot_general gives for a scalar input (was IndexError)."""
  lin = nnx.Linear(16, 4, rngs=nnx.Rngs(0),
                   dot_general=qlayers.QuantGemm("fp8_current"))
  stock = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError):
    stock(jnp.float32(1.0))
  with pytest.raises(TypeError, match=r"lhs \(\) has no dims"):
    lin(jnp.float32(1.0))


def test_eval_mode_runs_inside_a_loop_nnx_does_not_see():
  # A greedy decode loop (lax.fori_loop under nnx.jit) failed for delayed
  # scaling: eval mode still wrote the gradient amax from the loop's trace.
  m = qlayers.QuantDense(8, 8, rngs=nnx.Rngs(0), recipe=delayed())
  m.eval()
  before = pure(nnx.state(m, qlayers.QuantVariable))

  @nnx.jit
  def decode(m, x):
    return jax.lax.fori_loop(0, 3, lambda _, h: m(h) * 0.5, x)

  # No tanh between the steps: XLA's fused tanh may differ from the eager
  # one by an ulp (jax 0.12); halving is exact.
  x = jax.random.normal(jax.random.key(0), (2, 8))
  want = x
  for _ in range(3):
    want = m(want) * 0.5
  np.testing.assert_array_equal(decode(m, x), want)
  after = pure(nnx.state(m, qlayers.QuantVariable))
  for k in before:
    assert np.array_equal(before[k], after[k]), k


def test_a_training_layer_under_jax_jit_says_to_use_nnx_jit():
  # QuantDense (QuantGemm.matmul) raised NNX's bare TraceContextError.
  m = qlayers.QuantDense(8, 8, rngs=nnx.Rngs(0), recipe=delayed())
  with pytest.raises(RuntimeError, match="nnx.jit"):
    jax.jit(lambda x: m(x))(jnp.ones((2, 8)))


def test_eval_and_train_keep_the_graph_a_jitted_step_is_keyed_on():
  # The first model.eval() added use_running_average to the GEMM's static
  # fields: the graph changed and a jitted step compiled again.
  m = qlayers.QuantDense(8, 8, rngs=nnx.Rngs(0), recipe="fp8_current")
  before = nnx.graphdef(m)
  m.eval()
  m.train()
  assert nnx.graphdef(m) == before


def test_quant_gemm_takes_an_int_batch_shape():
  # As jnp.zeros takes a shape (was: 'int' object is not iterable).
  for n in (3, np.int64(3)):
    gemm = qlayers.QuantGemm("fp8_delayed", batch_shape=n)
    assert gemm.x_amax.shape == qlayers.QuantGemm(
        "fp8_delayed", batch_shape=(3,)).x_amax.shape == (3,)
