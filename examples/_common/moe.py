"""A mixture-of-experts variant of the example GPT (``gpt.py``).

Each block's MLP becomes an MoE layer: a router (``nnx.Linear``, kept
float32), top-k gating over ``n_experts`` experts, and two grouped GEMMs on
the token copies sorted by expert (`Experts`: stacked kernels
``[experts, in, out]`` applied with ``lax.ragged_dot``), plus the
Switch/GShard load-balancing loss. Dispatch and combine are
``qlayers.expert_parallel``'s: on one device a sort; under a mesh with an
``expert`` axis (``config.ep_axis``) the experts are sharded over it and the
token copies travel with ``all_to_all`` inside ``shard_map``, as FP8/MX
payloads with ``config.transport``; with an ``fsdp`` axis too
(``config.fsdp_axis``) each expert kernel is also split over it along K and
gathered before the GEMMs (quantized payloads + scales under a recipe).

``qlayers.quantize`` swaps the attention's ``nnx.Linear`` layers and puts a
``qlayers.layers.QuantRaggedDot`` (the recipe's grouped GEMM, one amax
history per expert) at each `Experts`'s ``ragged_dot``; the router and the
head stay wide.

Example::

  config = MoEConfig(vocab_size=256, max_len=64, d_model=64, n_layers=2,
                     n_heads=4, d_ff=256, n_experts=8, top_k=2)
  model = MoEGPT(config, rngs=nnx.Rngs(0))
  logits, aux = model.forward(jnp.zeros((2, 16), jnp.int32))
  # logits f32 [2, 16, 256]; aux: the mean load-balancing loss of the blocks
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import expert_parallel
from .gpt import CausalSelfAttention, GPTConfig, _dense, _norm

__all__ = ["MoEConfig", "Experts", "MoE", "MoEBlock", "MoEGPT",
           "load_balancing_loss", "loss_fn"]


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
  """`GPTConfig` plus the MoE layer's settings.

  Attributes:
    n_experts: experts per MoE layer.
    top_k: experts per token.
    d_expert: each expert's hidden width (0: ``d_ff // top_k``, so a token's
      active MLP parameters equal the dense GPT's).
    aux_weight: weight of the load-balancing loss in `loss_fn`.
    capacity: rows each device sends each other device under expert
      parallelism (None: nothing dropped).
    ep_axis: the mesh axis the experts are sharded over, when the mesh being
      traced under has it with more than one device.
    fsdp_axis: under expert parallelism, the mesh axis (if the mesh has it)
      the expert kernels are also split over along K (FSDP), the batch too.
    transport: recipe name whose formats the dispatched rows travel in
      (None: the compute dtype).
  """

  n_experts: int = 8
  top_k: int = 2
  d_expert: int = 0
  aux_weight: float = 0.01
  capacity: int | None = None
  ep_axis: str = "expert"
  fsdp_axis: str = "fsdp"
  transport: str | None = None

  @property
  def expert_width(self) -> int:
    return self.d_expert or self.d_ff // self.top_k


class Experts(nnx.Module):
  """``n`` expert matrices as one stacked ``kernel`` Param ``[n, in, out]``.

  ``__call__(x [m, in], group_sizes int32 [n]) -> [m, out]``: the first
  ``group_sizes[0]`` rows of ``x`` go through expert 0, and so on
  (``self.ragged_dot``, by default ``jax.lax.ragged_dot``; any function of
  its signature, e.g. ``qlayers.ops.ragged_dot(recipe)``).
  """

  def __init__(self, num_experts: int, in_features: int, out_features: int,
               *, dtype=None, kernel_init=nnx.initializers.normal(0.02),
               rngs: nnx.Rngs, ragged_dot=jax.lax.ragged_dot):
    self.kernel = nnx.Param(kernel_init(
        rngs.params(), (num_experts, in_features, out_features)))
    self.dtype = dtype
    self.ragged_dot = ragged_dot

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    w = self.kernel[...]
    if self.dtype is not None:
      x, w = x.astype(self.dtype), w.astype(self.dtype)
    if getattr(self.ragged_dot, "recipe", None) is None:
      # A plain GEMM takes whole kernels: an FSDP shard (expert_parallel.run
      # with fsdp) is gathered wide; qlayers' gather theirs quantized.
      w = expert_parallel.gather_weights(w)
    return self.ragged_dot(x, w, group_sizes)


def load_balancing_loss(probs: jax.Array, expert_ids: jax.Array) -> jax.Array:
  """Switch/GShard auxiliary loss ``n * sum_e f_e * P_e``: ``f_e`` the share
  of token copies routed to expert ``e``, ``P_e`` its mean router
  probability (1.0 when perfectly balanced)."""
  n = probs.shape[-1]
  share = jnp.mean(jax.nn.one_hot(expert_ids, n, dtype=jnp.float32),
                   axis=(0, 1))
  return n * jnp.sum(share * jnp.mean(probs, axis=0))


def _mesh_size(axis: str) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1)


class MoE(nnx.Module):
  """Top-k MoE MLP: ``down(gelu(up(x)))`` per expert, sorted dispatch."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    d, f, n = config.d_model, config.expert_width, config.n_experts
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    self.router = nnx.Linear(d, n, use_bias=False,
                             kernel_init=nnx.initializers.normal(0.02),
                             rngs=rngs)
    self.up = Experts(n, d, f, dtype=config.dtype, rngs=rngs)
    self.down = Experts(n, f, d, dtype=config.dtype, rngs=rngs,
                        kernel_init=nnx.initializers.normal(residual_std))
    self.config = config

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[B, T, d] -> ([B, T, d], load-balancing loss)``."""
    c = self.config
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    probs = jax.nn.softmax(self.router(tokens).astype(jnp.float32), axis=-1)
    gates, ids = jax.lax.top_k(probs, c.top_k)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    aux = load_balancing_loss(probs, ids)
    rows = tokens.astype(c.dtype) if c.dtype is not None else tokens
    if _mesh_size(c.ep_axis) == 1:
      xs, sizes, route = expert_parallel.dispatch(
          rows, ids, n_experts=c.n_experts)
      ys = self.down(jax.nn.gelu(self.up(xs, sizes)), sizes)
      y = expert_parallel.combine(ys, route, gates)
    else:
      graphdef, state = nnx.split((self.up, self.down))

      def experts(state, xs, sizes):
        up, down = nnx.merge(graphdef, state)
        ys = down(jax.nn.gelu(up(xs, sizes)), sizes)
        return ys, nnx.state((up, down))

      y, state = expert_parallel.run(
          experts, state, rows, ids, gates, n_experts=c.n_experts,
          axis=c.ep_axis, capacity=c.capacity, transport=c.transport,
          updates=True, fsdp=c.fsdp_axis)
      nnx.update((self.up, self.down), state)
    return y.reshape(b, t, d).astype(x.dtype), aux


class MoEBlock(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.attn_norm = _norm(config, rngs=rngs)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs=rngs)
    self.mlp = MoE(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
    y, aux = self.mlp(self.mlp_norm(x))
    return x + y, aux


class MoEGPT(nnx.Module):
  """Decoder-only MoE transformer LM (`gpt.GPT` with `MoE` MLPs).

  ``model(tokens)`` returns float32 logits (so ``lm.perplexity`` and
  ``lm.generate`` work); ``model.forward(tokens)`` returns ``(logits,
  aux)``, ``aux`` the blocks' mean load-balancing loss.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(
        config.vocab_size, config.d_model,
        embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
    )
    self.blocks = nnx.List(
        [MoEBlock(config, rngs=rngs) for _ in range(config.n_layers)]
    )
    self.final_norm = _norm(config, rngs=rngs)
    self.head = _dense(config, config.d_model, config.vocab_size, std=0.02,
                       rngs=rngs)
    self.config = config

  def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = self.embed(tokens)
    aux = jnp.zeros((), jnp.float32)
    for block in self.blocks:
      x, a = block(x)
      aux = aux + a
    logits = self.head(self.final_norm(x)).astype(jnp.float32)
    return logits, aux / len(self.blocks)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.forward(tokens)[0]


def loss_fn(model: MoEGPT, inputs: jax.Array, targets: jax.Array):
  """Next-token cross-entropy plus ``aux_weight`` times the balancing loss;
  returns ``(loss, cross_entropy)``."""
  logits, aux = model.forward(inputs)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  return ce + model.config.aux_weight * aux, ce
