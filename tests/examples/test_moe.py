"""The MoE GPT example (examples/_common/moe.py): shapes, the balancing
loss, dispatch against a per-token loop, and conversion."""

import jax
import jax.numpy as jnp
import numpy as np
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
  import pytest  # pylint: disable=g-import-not-at-top
  import train_moe  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    train_moe.main(["--recipes", "fp8_current,nope"])
  assert e.value.code == 2
  assert "unknown recipe 'nope'" in capsys.readouterr().err
