"""The MoE GPT example (examples/_common/moe.py): shapes, the balancing
loss, dispatch against a per-token loop, and conversion."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from _common import moe

CONFIG = moe.MoEConfig(vocab_size=32, max_len=8, d_model=16, n_layers=1,
                       n_heads=2, d_ff=32, n_experts=4, top_k=2)


def test_load_balancing_loss_is_one_when_balanced():
  probs = jnp.full((4, 4), 0.25)
  ids = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]], jnp.int32)
  assert float(moe.load_balancing_loss(probs, ids)) == 1.0
  # All tokens on experts 0 and 1, which hold all the probability: 2.
  skewed = jnp.array([[0, 1]] * 4, jnp.int32)
  peaked = jnp.tile(jnp.array([[0.5, 0.5, 0.0, 0.0]]), (4, 1))
  assert float(moe.load_balancing_loss(peaked, skewed)) == 2.0


def test_moe_layer_matches_a_loop_over_tokens():
  layer = moe.MoE(CONFIG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 3, 16))
  y, aux = layer(x)
  tokens = x.reshape(6, 16)
  probs = jax.nn.softmax(tokens @ layer.router.kernel[...], axis=-1)
  gates, ids = jax.lax.top_k(probs, 2)
  gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  up, down = layer.up.kernel[...], layer.down.kernel[...]
  want = np.stack([
      sum(float(gates[t, j]) * np.asarray(
          jax.nn.gelu(tokens[t] @ up[ids[t, j]]) @ down[ids[t, j]])
          for j in range(2)) for t in range(6)])
  np.testing.assert_allclose(np.asarray(y).reshape(6, 16), want, rtol=1e-5,
                             atol=1e-6)
  assert aux.shape == ()


def test_quantize_converts_experts_and_keeps_router_wide():
  model = moe.MoEGPT(CONFIG, rngs=nnx.Rngs(0))
  params = jax.tree.map(jnp.shape, nnx.state(model, nnx.Param))
  report = qlayers.quantize(model, "fp8_current")
  converted = {c.path for c in report.converted}
  assert {"blocks/0/mlp/up", "blocks/0/mlp/down"} <= converted
  assert "blocks/0/mlp/router" not in converted
  assert jax.tree.map(jnp.shape, nnx.state(model, nnx.Param)) == params
  logits, aux = model.forward(jnp.zeros((2, 8), jnp.int32))
  assert logits.shape == (2, 8, 32) and bool(jnp.isfinite(aux))


def test_train_moe_refuses_unknown_recipe_before_training(capsys):
  import train_moe  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    train_moe.main(["--recipes", "fp8_current,nope"])
  assert e.value.code == 2
  assert "unknown recipe 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--fsdp", "2"], "--fsdp 2 needs --expert-parallel > 1"),
    (["--expert-parallel", "4096"], "needs 4096 devices")])
def test_train_moe_refuses_a_mesh_it_cannot_make(capsys, flags, message):
  import train_moe  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    train_moe.main(flags)
  assert e.value.code == 2
  assert message in capsys.readouterr().err



# Tunix's Qwen3-MoE layer (examples/_common/moe_qwen3.py's tiny config).
# Tunix builds Params with Flax's deprecated `sharding=` metadata and reads
# JAX's deprecated pxla.thread_resources.
_TUNIX = [pytest.mark.filterwarnings(w) for w in (
    "ignore:'sharding' is deprecated:DeprecationWarning",
    "ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning")]


@pytest.fixture(scope="module")
def tunix_moe():
  """A stock Tunix ``MoELayer`` (4 experts, top 2, D 32, F 64), its Params
  drawn by NumPy (eager JAX initialisers take seconds here)."""
  q3 = pytest.importorskip("tunix.models.qwen3.model",
                           reason="google-tunix is not installed")
  from _common import moe_qwen3  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    graph, state = nnx.split(nnx.eval_shape(
        lambda: q3.MoELayer(moe_qwen3.tiny_config(), rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  layer = nnx.merge(graph, jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype), state))
  x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
  # Tunix's own forward (a loop over experts, FP32); eager ops take 10x as
  # long here as one jit.
  return layer, x, nnx.jit(lambda m, x: m(x))(layer, x)


def _convert(layer, recipe):
  # pylint: disable-next=g-import-not-at-top
  from qlayers.integrations import tunix as qtunix
  model = nnx.Dict(mlp=layer)
  return model, qtunix.quantize(model, recipe)


@pytest.mark.parametrize("recipe,bound", [("bf16", 2e-2),
                                          ("fp8_current", 0.15)])
@_TUNIX[0]
@_TUNIX[1]
def test_tunix_moe_experts_converted_and_compute_the_stock_layer(
    tunix_moe, recipe, bound):
  layer, x, want = tunix_moe
  model, report = _convert(nnx.clone(layer), recipe)
  assert [(c.path, c.new_type) for c in report.converted] == [
      ("mlp", "QuantTunixMoE")]
  wide = {k.path: k.why for k in report.kept_wide}
  assert "router of the 4 experts" in wide["mlp/router"]
  moe_layer = model["mlp"]
  assert moe_layer.gate_proj.get_metadata()["out_sharding"] == (
      "fsdp", None, "tp")  # Tunix's Param, sharding names and all
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.state(m, nnx.Param))  # noqa: E731
  assert shapes(model) == shapes(nnx.Dict(mlp=layer))  # checkpoints load
  got = nnx.jit(lambda m, x: m(x))(moe_layer, x)
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert 0 < err < bound, err


@_TUNIX[0]
@_TUNIX[1]
def test_tunix_moe_capacity_factor_drops_only_past_capacity(tunix_moe):
  layer, x, _ = tunix_moe
  model, _ = _convert(nnx.clone(layer), "fp8_current")
  moe_layer = model["mlp"]
  call = nnx.jit(lambda m, x: m(x))
  exact = call(moe_layer, x)
  # 16 tokens, top 2 of 4 experts: an expert gets at most 16 copies, which
  # capacity_factor 2 (ceil(2 * 32 / 4) = 16 rows per buffer, not 32) holds.
  moe_layer.capacity_factor = 2.0
  np.testing.assert_array_equal(call(moe_layer, x), exact)
  moe_layer.capacity_factor = 0.5  # 4 rows per expert: copies are dropped
  assert not np.array_equal(call(moe_layer, x), exact)


@_TUNIX[0]
@_TUNIX[1]
def test_tunix_moe_quantized_step_updates_experts_and_their_scales(tunix_moe):
  layer, x, _ = tunix_moe
  model, _ = _convert(nnx.clone(layer), "fp8_delayed")
  moe_layer = model["mlp"]
  before = {p: np.asarray(getattr(moe_layer, p)[...])
            for p in ("gate_proj", "up_proj", "down_proj")}
  _, ids = jax.lax.top_k(moe_layer.router(x), 2)
  routed = np.bincount(np.asarray(ids).ravel(), minlength=4) > 0
  optimizer = qlayers.Optimizer(model, optax.sgd(0.1))

  @nnx.jit
  def step(model, optimizer):
    _, grads = qlayers.value_and_grad(
        lambda m: jnp.mean(m["mlp"](x) ** 2))(model)
    optimizer.update(model, grads)

  step(model, optimizer)
  for name, old in before.items():
    assert not np.array_equal(getattr(moe_layer, name)[...], old), name
  # One amax history per expert and weight: the weights' amax per expert,
  # and the output gradient's only for experts that got tokens.
  np.testing.assert_array_equal(moe_layer.gate_quant.w_amax_history[:, 0],
                                np.abs(before["gate_proj"]).max((1, 2)))
  assert ((moe_layer.down_quant.g_amax_history[:, 0] > 0) == routed).all()
  # qlayers.inspect tells its three grouped GEMMs apart.
  from qlayers.inspect import _tap  # pylint: disable=g-import-not-at-top
  assert set(_tap.gemm_paths(model)) == {
      "mlp:gate_quant", "mlp:up_quant", "mlp:down_quant"}


# qlayers.inspect sees the grouped GEMMs (QuantRaggedDot), one site per
# expert with tokens. Equal group sizes: one shape, one compile of the
# statistics.
_SIZES = jnp.array([3, 0, 3, 3], jnp.int32)  # expert 1 gets no token


def test_inspect_collect_measures_each_expert_of_a_grouped_gemm():
  layer = qlayers.QuantExperts(4, 32, 16, recipe="fp8_current",
                               rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (9, 32))
  report = qlayers.inspect.collect(
      layer, lambda m, x: jnp.mean(m(x, _SIZES) ** 2), x)
  rows = {(r.path, r.role): r for r in report.rows}
  assert {p for p, _ in rows} == {"(model)[0]", "(model)[2]", "(model)[3]"}
  assert not report.skipped
  kernel = np.asarray(layer.kernel[...])
  for e, start in ((0, 0), (2, 3), (3, 6)):  # each expert's own operands
    assert rows[f"(model)[{e}]", "w"].amax == np.abs(kernel[e]).max()
    assert rows[f"(model)[{e}]", "x"].amax == float(
        jnp.abs(x[start:start + 3]).max())
    assert rows[f"(model)[{e}]", "g"].amax > 0


def test_inspect_sensitivity_masks_the_expert_gemms():
  from _common import moe as moe_example  # pylint: disable=g-import-not-at-top
  model = nnx.Dict(up=moe_example.Experts(4, 32, 32, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (9, 32))
  res = qlayers.inspect.sensitivity(
      model, lambda m, x: jnp.mean(m["up"](x, _SIZES) ** 2), [x], "mxfp4",
      gemms=False, grads=False)
  # The unquantized reference runs the experts wide (they were quantized in
  # every pass before the grouped GEMM went through the inspection hook).
  assert [c.path for c in res.layers] == ["up"]
  assert res.all_loss != res.wide_loss
  assert res.layers[0].loss == res.all_loss
