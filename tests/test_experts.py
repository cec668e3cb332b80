"""QuantExperts and QuantRaggedDot: Params of a stock MoE's stacked experts,
the grouped GEMM of `qlayers.ops.ragged_dot`, per-expert delayed state
through a training step, eval mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers import ops
from qlayers.layers import QuantRaggedDot
from qlayers.layers.experts import QuantExpertsEinsum

SIZES = jnp.array([3, 0, 4, 1], jnp.int32)


class StockExperts(nnx.Module):
  """Stacked experts the usual way, the grouped GEMM an attribute."""

  def __init__(self, e, k, n, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (e, k, n)) * 0.1)
    self.ragged_dot = jax.lax.ragged_dot

  def __call__(self, x, group_sizes):
    return self.ragged_dot(x, self.kernel[...], group_sizes)


def _x(m=8, k=32, seed=0):
  return jax.random.normal(jax.random.key(seed), (m, k))


def test_params_and_output_match_the_op():
  layer = qlayers.QuantExperts(4, 32, 16, use_bias=True, recipe="fp8_current",
                               bias_init=nnx.initializers.ones_init(),
                               rngs=nnx.Rngs(0))
  shapes = jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param))
  assert shapes["kernel"].get_value() == (4, 32, 16)
  assert shapes["bias"].get_value() == (4, 16)
  x = _x()
  layer.bias[...] = jnp.arange(4.0)[:, None] * jnp.ones((4, 16))
  y = layer(x, jnp.array([3, 0, 4, 0], jnp.int32))
  want = ops.ragged_dot("fp8_current")(x, layer.kernel[...],
                                       jnp.array([3, 0, 4, 0], jnp.int32))
  bias = jnp.array([0.0] * 3 + [2.0] * 4 + [0.0])[:, None]
  np.testing.assert_array_equal(y, want + bias)
  assert not np.asarray(y[7]).any()  # past the groups: 0, no bias


def test_delayed_state_per_expert_through_a_training_step():
  layer = qlayers.QuantExperts(4, 32, 16, recipe="fp8_delayed",
                               rngs=nnx.Rngs(0))
  assert layer.quant.x_amax_history.shape == (4, 1024)
  x = _x()
  loss = lambda m, x: jnp.sum(m(x, SIZES) * 3.0)  # noqa: E731
  _, grads = nnx.jit(qlayers.value_and_grad(loss))(layer, x)
  qlayers.update_scales(layer, grads)
  starts = np.concatenate([[0], np.cumsum(SIZES)])
  want_x = [float(jnp.max(jnp.abs(x[a:b]))) if b > a else 0.0
            for a, b in zip(starts[:-1], starts[1:])]
  np.testing.assert_array_equal(layer.quant.x_amax_history[:, 0], want_x)
  # An expert given no tokens records nothing, as a QuantDense called on
  # an empty batch (it recorded its weight's amax: found by audit).
  np.testing.assert_array_equal(
      layer.quant.w_amax_history[:, 0],
      jnp.max(jnp.abs(layer.kernel[...]), axis=(1, 2)).at[1].set(0.0))
  np.testing.assert_array_equal(layer.quant.g_amax_history[:, 0],
                                [3.0, 0.0, 3.0, 3.0])
  assert not np.asarray(layer.quant.x_amax[...]).any()  # cleared


def test_eval_mode_writes_no_state():
  layer = qlayers.QuantExperts(4, 32, 16, recipe="fp8_delayed",
                               rngs=nnx.Rngs(0))
  layer.eval()
  layer(_x(), SIZES)
  assert not np.asarray(layer.quant.x_amax[...]).any()
  layer.train()
  layer(_x(), SIZES)
  assert np.asarray(layer.quant.x_amax[...])[0] > 0


def test_quant_ragged_dot_injected_into_a_stock_module():
  stock = StockExperts(4, 32, 16, nnx.Rngs(0))
  x = _x()
  want = ops.ragged_dot("fp8_current")(x, stock.kernel[...], SIZES)
  stock.ragged_dot = nnx.data(QuantRaggedDot("fp8_current", num_groups=4))
  np.testing.assert_array_equal(stock(x, SIZES), want)


def test_refusals():
  layer = qlayers.QuantExperts(4, 32, 16, recipe="fp8_current",
                               rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"tokens of shape \(m, 32\)"):
    layer(jnp.ones((2, 3, 32)), SIZES)
  for name in ("fp8_delayed", "nvfp4"):  # state or rounding seeds per expert
    rd = QuantRaggedDot(name, num_groups=4)
    with pytest.raises(ValueError, match=r"keeps state for 4 experts "
                       r"\(num_groups=4\), but the weights hold 2"):
      rd(_x(), jnp.ones((2, 32, 16)), SIZES[:2])
  ein = QuantExpertsEinsum("ecd,edf->ecf", (4, 32, 16), recipe="fp8_current",
                           rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"the input has 3 experts \(dim 0 of "
                     r"\(3, 5, 32\)\), the weights 4"):
    ein(jnp.ones((3, 5, 32)))
  with pytest.raises(NotImplementedError, match="group_offset"):
    rd(_x(), jnp.ones((4, 32, 16)), SIZES, group_offset=jnp.array([0]))


def test_expert_einsum_is_a_loop_over_experts():
  """Capacity buffers after a one-hot dispatch: each expert its own GEMM
  with its own scales, bit for bit, forward and both gradients."""
  layer = QuantExpertsEinsum("ecd,edf->ecf", (3, 32, 16), recipe="mxfp8",
                             rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 5, 32))
  x = x * jnp.array([1.0, 0.0, 30.0])[:, None, None]  # an idle expert

  def loop(x, w):
    dg = ops.dot_general("mxfp8")
    y = jnp.stack([dg(x[e], w[e], (((1,), (0,)), ((), ()))) for e in range(3)])
    return jnp.sum(y ** 2)  # the layer's loss, summed in the same order

  ours = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2),
                                    argnums=(0, 1)))
  value, (grads, dx) = ours(layer, x)
  want, (dx_want, dw_want) = jax.jit(jax.value_and_grad(loop, (0, 1)))(
      x, layer.kernel[...])
  np.testing.assert_array_equal(value, want)
  np.testing.assert_array_equal(dx, dx_want)
  np.testing.assert_array_equal(grads["kernel"].get_value(), dw_want)
  assert not np.asarray(dw_want[1]).any()


def test_expert_einsum_delayed_state_per_expert():
  layer = QuantExpertsEinsum("ecd,edf->ecf", (3, 32, 16), recipe="fp8_delayed",
                             rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 5, 32))
  x = x * jnp.array([1.0, 2.0, 4.0])[:, None, None]
  _, grads = nnx.jit(qlayers.value_and_grad(
      lambda m, x: jnp.sum(m(x)) * 3.0))(layer, x)
  qlayers.update_scales(layer, grads)
  np.testing.assert_array_equal(layer.quant.x_amax_history[:, 0],
                                jnp.max(jnp.abs(x), axis=(1, 2)))
  np.testing.assert_array_equal(layer.quant.g_amax_history[:, 0], [3.0] * 3)
  with pytest.raises(ValueError, match="not batched over the kernel's "
                     "leading"):
    QuantExpertsEinsum("cd,edf->cef", (3, 32, 16), rngs=nnx.Rngs(0))


def test_step_keyed_rounding_per_expert():
  """``sr_key = "step"`` (nvfp4): each expert's rounding key comes from its
  own (seed, step) counter, which every training call advances, not from
  the data: the same batch twice rounds the gradients differently."""
  layer = qlayers.QuantExperts(3, 32, 32, recipe="nvfp4", rngs=nnx.Rngs(0))
  grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x, SIZES[:3]) ** 2),
                          argnums=(0, 1)))
  x = _x(7, 32)
  (_, dx1), (_, dx2) = grad(layer, x), grad(layer, x)
  seeds = layer.quant.sr_seed[...]  # from the initial kernel, one per expert
  np.testing.assert_array_equal(seeds - seeds[0], [0, 1, 2])
  np.testing.assert_array_equal(layer.quant.sr_step[...], [2, 2, 2])
  assert not np.array_equal(dx1, dx2)


def test_capacity_drops_rows_and_their_bias():
  layer = qlayers.QuantExperts(4, 32, 16, use_bias=True, capacity=2,
                               recipe="fp8_current",
                               bias_init=nnx.initializers.ones_init(),
                               rngs=nnx.Rngs(0))
  y = layer(_x(), SIZES)  # groups of 3, 0, 4, 1 rows: rows 2, 5, 6 dropped
  assert layer.quant.capacity == 2
  dropped = np.asarray(y)[[2, 5, 6]]
  assert not dropped.any()
  assert np.asarray(y)[[0, 1, 3, 4, 7]].all()


def test_intercept_routes_the_grouped_gemm_with_its_keywords():
  """Inside `qlayers.ops.intercept` an experts layer's grouped GEMM goes to
  the intercepting function, with the layer as its site and the grouped
  GEMM's own keywords; the function's result is the layer's, and a call
  without a site, or outside the block, is not routed."""
  rd = QuantRaggedDot("fp8_current", num_groups=4, capacity=3)
  x, w = _x(), jax.random.normal(jax.random.key(1), (4, 32, 16))
  seen = []

  def fn(site, x, w, recipe, state, **kw):
    seen.append((site, recipe.name, sorted(kw), int(kw["capacity"])))
    y, new_state = ops.quantized_ragged_dot(x, w, recipe=recipe, state=state,
                                            **kw)
    return y * 2.0, new_state

  want = rd(x, w, SIZES)
  with ops.intercept(fn):
    got = rd(x, w, SIZES)
    direct, _ = ops.quantized_ragged_dot(x, w, SIZES, "fp8_current",
                                         capacity=3)
  assert seen == [(rd, "fp8_current",
                   ["backend", "capacity", "group_sizes", "key", "out_dtype"],
                   3)]
  np.testing.assert_array_equal(got, want * 2.0)
  np.testing.assert_array_equal(direct, want)


def test_params_take_metadata_as_nnx_layers_do():
  layer = qlayers.QuantExperts(2, 32, 16, use_bias=True, recipe="fp8_current",
                               kernel_metadata={"tag": "experts_kernel"},
                               bias_metadata={"tag": "experts_bias"},
                               rngs=nnx.Rngs(0))
  assert layer.kernel.get_metadata()["tag"] == "experts_kernel"
  assert layer.bias.get_metadata()["tag"] == "experts_bias"


def test_einsum_through_a_stateful_dot_general_says_what_to_do():
  # jnp.einsum runs its _dot_general under its own jit, where the delayed
  # state cannot be written: NNX's TraceContextError said nothing of why.
  rd = QuantRaggedDot("fp8_delayed", num_groups=2)
  x, w = jnp.ones((2, 4, 32)), jnp.ones((2, 32, 16))
  with pytest.raises(RuntimeError, match="call this GEMM directly"):
    jnp.einsum("ecd,edf->ecf", x, w, _dot_general=rd.dot_general)
  dims = (((2,), (1,)), ((0,), (0,)))
  assert rd.dot_general(x, w, dims).shape == (2, 4, 16)
  stateless = QuantRaggedDot("fp8_current", num_groups=2)
  assert jnp.einsum("ecd,edf->ecf", x, w,
                    _dot_general=stateless.dot_general).shape == (2, 4, 16)
