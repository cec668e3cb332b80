"""qlayers.value_and_grad and accumulate_grads: gradient-side quantization
state combined exactly (by max) across uses and micro-batches."""

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


def _reused(uses):
  """A layer and a loss using it ``uses`` times (2 or 3) in one step, with
  output-gradient amaxes 3, 5 (and 4): a max of 5, a sum of 8 (12)."""
  m = qlayers.QuantDense(16, 8, use_bias=False, rngs=nnx.Rngs(0),
                         recipe=delayed())
  keys = jax.random.split(jax.random.key(0), 3)
  xs = [s * jax.random.normal(k, (4, 16)) for s, k in zip((1., 2., 1.), keys)]
  cs = [jnp.full((4, 8), 0.5).at[0, 0].set(-3.0),
        jnp.full((4, 8), 0.25).at[1, 2].set(5.0),
        jnp.full((4, 8), 0.25).at[3, 1].set(4.0)]

  def loss_fn(m):
    return sum(weighted_sum(m(x), c) for x, c in zip(xs[:uses], cs[:uses]))

  x_amax = max(float(jnp.max(jnp.abs(x))) for x in xs[:uses])
  return m, loss_fn, x_amax


STOCK = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))


@pytest.mark.parametrize("how", ["eager", "jit", "stock"])
@pytest.mark.parametrize("uses", [2, 3])
def test_layer_used_several_times_combines_by_max(uses, how):
  """Gradient amaxes 3 and 5 (and 4) give 5, not their sum: eagerly, under
  nnx.jit, and with stock nnx.value_and_grad over a DiffState."""
  m, loss_fn, x_amax = _reused(uses)
  vg = (nnx.value_and_grad(loss_fn, argnums=STOCK) if "stock" in how
        else qlayers.value_and_grad(loss_fn))
  if how == "jit":
    vg = nnx.jit(vg)
  _, grads = vg(m)
  assert float(grads["quant"]["g_amax"][...]) == 5.0
  assert float(m.quant.x_amax[...]) == x_amax
  assert float(m.quant.g_amax[...]) == 0.0  # passed through, unchanged
  opt = qlayers.Optimizer(m, optax.sgd(0.0))
  opt.update(m, grads)
  assert float(m.quant.g_amax_history[...][0]) == 5.0
  assert float(m.quant.x_amax_history[...][0]) == x_amax


def test_accumulate_grads_over_micro_batches():
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=delayed())
  xs = jax.random.normal(jax.random.key(1), (2, 4, 16)) * jnp.array(
      [1.0, 3.0]).reshape(2, 1, 1)
  cs = [jnp.full((4, 8), 1.0).at[2, 3].set(3.0),
        jnp.full((4, 8), -1.0).at[0, 5].set(-5.0)]
  vg = qlayers.value_and_grad(lambda m, x, c: weighted_sum(m(x), c))
  total, per = None, []
  for x, c in zip(xs, cs):
    _, g = vg(m, x, c)
    per.append(g)
    total = qlayers.accumulate_grads(total, g)
  assert [float(g["quant"]["g_amax"][...]) for g in per] == [3.0, 5.0]
  assert float(total["quant"]["g_amax"][...]) == 5.0  # max, not 3 + 5
  want = per[0]["kernel"][...] + per[1]["kernel"][...]
  assert np.array_equal(total["kernel"][...], want)
  # Forward state accumulated over the micro-batches in the layer itself.
  assert float(m.quant.x_amax[...]) == float(jnp.max(jnp.abs(xs)))
  opt = qlayers.Optimizer(m, optax.sgd(0.0))
  opt.update(m, total)
  assert float(m.quant.g_amax_history[...][0]) == 5.0
  assert float(m.quant.x_amax_history[...][0]) == float(jnp.max(jnp.abs(xs)))
  with pytest.raises(TypeError, match="grads must be an nnx.State"):
    qlayers.accumulate_grads(total, m)


def test_accumulated_bf16_gradients_are_summed_in_fp32():
  """BF16 micro-batch gradients add up in FP32: their sum is exact where
  BF16 partial sums would round every step."""
  m = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe="bf16",
                         dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  vg = qlayers.value_and_grad(lambda m, x: jnp.sum(m(x)))
  xs = jax.random.normal(jax.random.key(0), (16, 4, 16), jnp.bfloat16)
  per = [vg(m, x)[1] for x in xs]
  total = None
  for g in per:
    total = qlayers.accumulate_grads(total, g)
  assert total["kernel"][...].dtype == jnp.float32
  want = sum(np.asarray(g["kernel"][...], np.float64) for g in per)
  np.testing.assert_array_equal(np.asarray(total["kernel"][...], np.float64),
                                want)


def test_loss_scale_reaches_value_and_grad():
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe="bf16")
  x = jnp.ones((2, 8))
  f = lambda m: jnp.mean(m(x) ** 2)
  _, g1 = qlayers.value_and_grad(f)(m)
  _, g8 = qlayers.value_and_grad(f, loss_scale=8.0)(m)
  np.testing.assert_allclose(g8["kernel"][...], 8 * g1["kernel"][...],
                             rtol=1e-6)


def _mlp(recipe):
  return nnx.Sequential(
      qlayers.QuantDense(16, 32, rngs=nnx.Rngs(0), recipe=recipe), nnx.relu,
      qlayers.QuantDense(32, 8, rngs=nnx.Rngs(1), recipe=recipe))


BATCH = None  # rebound by the loop of the test below


def _global_loss(m):
  x, y = BATCH
  return jnp.mean((m(x).astype(jnp.float32) - y) ** 2)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8"])
def test_eager_call_reads_the_global_batch_like_nnx(recipe):
  """A loss reading a global batch the loop rebinds: every eager call sees
  the current batch, with nnx.value_and_grad's losses and gradients (the
  quantization state differentiated as a DiffState), step after step."""
  global BATCH
  ours, stock = _mlp(recipe), _mlp(recipe)
  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
  losses = []
  for i in range(3):
    kx, ky = jax.random.split(jax.random.key(i))
    BATCH = (jax.random.normal(kx, (4, 16)) * (i + 1),
             jax.random.normal(ky, (4, 8)) * 2.0 ** i)
    loss, grads = qlayers.value_and_grad(_global_loss)(ours)
    want_loss, want = nnx.value_and_grad(_global_loss, argnums=diff)(stock)
    assert np.array_equal(loss, want_loss), i
    assert pure(grads).keys() == pure(want).keys()
    for k, v in pure(want).items():
      assert np.array_equal(pure(grads)[k], v), (i, k)
    for m, g in ((ours, grads), (stock, want)):
      qlayers.update_scales(m, g)
    losses.append(float(loss))
  assert len(set(losses)) == 3, losses
  for k, v in pure(nnx.state(stock)).items():
    assert np.array_equal(pure(nnx.state(ours))[k], v), k


def test_jitted_step_matches_nnx_value_and_grad():
  """Under nnx.jit (the fast loop) the same values as nnx.value_and_grad."""
  def loss_fn(m, x, y):
    return jnp.mean((m(x).astype(jnp.float32) - y) ** 2)

  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
  steps = {
      "ours": nnx.jit(lambda m, x, y: qlayers.value_and_grad(loss_fn)(m, x,
                                                                      y)),
      "stock": nnx.jit(lambda m, x, y: nnx.value_and_grad(
          loss_fn, argnums=diff)(m, x, y))}
  runs = {}
  for name, step in steps.items():
    m, out = _mlp("fp8_delayed"), []
    for i in range(3):
      x = jax.random.normal(jax.random.key(i), (4, 16)) * (i + 1)
      loss, grads = step(m, x, jnp.ones((4, 8)) * i)
      qlayers.update_scales(m, grads)
      out.append((float(loss), pure(grads)))
    runs[name] = out
  assert len({loss for loss, _ in runs["ours"]}) == 3
  for (l1, g1), (l2, g2) in zip(runs["ours"], runs["stock"]):
    assert l1 == l2 and g1.keys() == g2.keys()
    for k in g2:
      assert np.array_equal(g1[k], g2[k]), k


def test_other_nnx_arguments_are_merged_and_written_back():
  """An nnx.Rngs or a second (delayed, eval-mode) model among the loss's
  arguments: the same loss and gradients as nnx.value_and_grad, their
  state written back, only the model differentiated."""

  class Net(nnx.Module):
    def __init__(self, recipe, seed):
      self.l = qlayers.QuantDense(8, 8, recipe=recipe, rngs=nnx.Rngs(seed))
      self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
      return self.drop(self.l(x), rngs=rngs)

  def loss(student, teacher, x, rngs):
    return jnp.mean((student(x, rngs) - teacher(x)) ** 2)

  x = jax.random.normal(jax.random.key(0), (4, 8))
  teacher = Net("fp8_delayed", 1)
  teacher.eval()
  got, want = [], []
  for vg, out in ((qlayers.value_and_grad(loss), got),
                  (nnx.value_and_grad(loss), want)):
    rngs = nnx.Rngs(dropout=3)
    out.append(vg(Net("fp8_current", 0), teacher, x, rngs))
    out.append(int(rngs.dropout.count[...]))
  (l1, g1), n1 = got
  (l2, g2), n2 = want
  assert float(l1) == float(l2) and n1 == n2 == 1
  # A keyword argument too.
  l3, _ = qlayers.value_and_grad(lambda s, t, x, *, rngs: loss(s, t, x, rngs))(
      Net("fp8_current", 0), teacher, x, rngs=nnx.Rngs(dropout=3))
  assert float(l3) == float(l1)
  np.testing.assert_array_equal(g1["l"]["kernel"][...], g2["l"]["kernel"][...])
  assert sorted(g1["l"].keys()) == ["bias", "kernel"]



def test_a_loss_that_is_not_a_real_scalar_is_refused():
  # The gradient of the loss's sum came back silently (nnx raises).
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="real scalar.*shape \\(2, 4\\)"):
    qlayers.value_and_grad(lambda m: m(jnp.ones((2, 8))))(m)
  with pytest.raises(TypeError, match="has_aux=True"):
    qlayers.value_and_grad(lambda m: (jnp.sum(m(jnp.ones((2, 8)))),
                                      {"acc": 1.0}))(m)


def test_average_grads_divides_the_params_and_keeps_the_amaxes():
  # Dividing every leaf divided the gradient amaxes too: the next steps'
  # FP8 gradients saturated.
  m = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0), recipe="fp8_delayed")
  x = jnp.linspace(-1, 1, 16).reshape(2, 8)
  total = None
  for c in (1.0, 3.0):
    _, g = qlayers.value_and_grad(lambda m: c * jnp.sum(m(x)))(m)
    total = qlayers.accumulate_grads(total, g)
  mean = qlayers.average_grads(total, 2)
  np.testing.assert_allclose(mean["kernel"][...], total["kernel"][...] / 2)
  assert float(mean["quant"]["g_amax"][...]) == 3.0
  with pytest.raises(ValueError, match="positive int"):
    qlayers.average_grads(total, 0)


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp4"])
def test_second_derivatives_of_a_quantized_gemm_are_refused(recipe):
  """jax.hessian / grad of grad through a quantized GEMM differentiated its
  rules' quantize casts: wrong Hessians, all zero for MXFP4. Now an error;
  a wide recipe keeps its exact second derivative."""
  def loss(recipe):
    layer = qlayers.QuantDense(16, 8, use_bias=False, recipe=recipe,
                               rngs=nnx.Rngs(0))
    layer.eval()
    graphdef, state = nnx.split(layer)
    kernel = layer.kernel[...]
    return (lambda x: jnp.sum(nnx.merge(graphdef, state)(x) ** 2)), kernel

  f, _ = loss(recipe)
  x = jnp.linspace(-1.0, 1.0, 16)
  assert jax.grad(f)(x).shape == (16,)  # first order as before
  with pytest.raises(TypeError, match="no second derivative"):
    jax.hessian(f)(x)
  with pytest.raises(TypeError, match="no second derivative"):
    jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
  wide, kernel = loss("bf16")
  want = 2 * kernel @ kernel.T
  np.testing.assert_allclose(jax.hessian(wide)(x), want, rtol=0.02,
                             atol=0.02 * float(jnp.abs(want).max()))


def test_average_grads_takes_any_integer_count():
  grads = nnx.State({"w": nnx.Param(jnp.full((2,), 4.0))})
  assert average_grads_w(grads, np.int64(2)) == [2.0, 2.0]
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match="n must be a positive int"):
      qlayers.average_grads(grads, bad)


def average_grads_w(grads, n):
  return qlayers.average_grads(grads, n)["w"][...].tolist()
