"""A third-party NNX MoE under qlayers: Tunix's Qwen3-MoE, tiny config.

``google-tunix`` (``examples/requirements-tunix.txt``) ships Qwen3 with an
MoE layer (``tunix.models.qwen3.model.MoELayer``: stacked ``gate_proj``,
``up_proj``, ``down_proj`` Params used by its own einsums, a Python loop
over experts off TPU). `train` converts it with
``qlayers.integrations.tunix.quantize`` (Tunix's ``Einsum`` layers, and its
``MoELayer`` as a ``QuantTunixMoE``: the same Params, the three expert
GEMMs grouped and quantized, the router wide) and trains a few steps with
``qlayers.value_and_grad`` and ``qlayers.Optimizer``; the conversion report
says what was converted.

Example::

  losses, report = train("fp8_current", steps=3)
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import qlayers


def tiny_config(experts: int = 4, top_k: int = 2):
  from tunix.models.qwen3 import model as q3  # pylint: disable=g-import-not-at-top
  return q3.ModelConfig(
      num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2,
      head_dim=16, num_kv_heads=1, rope_theta=10000, norm_eps=1e-6,
      num_experts=experts, num_experts_per_tok=top_k,
      shd_config=q3.ShardingConfig.get_default_sharding())


def train(recipe: str, *, steps: int = 3, seed: int = 0):
  """``(losses, conversion report)`` of ``steps`` AdamW steps on random
  tokens (batch 2, 8 tokens) of a tiny Qwen3-MoE quantized by ``recipe``."""
  from tunix.models.qwen3 import model as q3  # pylint: disable=g-import-not-at-top
  from qlayers.integrations import tunix as qtunix  # pylint: disable=g-import-not-at-top
  model = q3.Qwen3(tiny_config(), rngs=nnx.Rngs(seed))
  report = qtunix.quantize(model, recipe)
  tokens = jax.random.randint(jax.random.key(seed), (2, 9), 0, 64)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))

  def loss_fn(m):
    logits, _ = m(inputs, positions, None, mask)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

  optimizer = qlayers.Optimizer(model, optax.adamw(1e-2))

  @nnx.jit
  def step(model, optimizer):
    loss, grads = qlayers.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)], report
