"""Tunix's mixture-of-experts layer with its expert GEMMs quantized.

Tunix's Qwen3-MoE layer (``tunix.models.qwen3.model.MoELayer``) holds its
experts as three stacked Params, ``gate_proj [E, D, F]``, ``up_proj [E, D,
F]`` and ``down_proj [E, F, D]``, and applies them from its own
``__call__``: off TPU a Python loop over the experts on a one-hot dispatch
(every expert on every token), on TPU Megablox's grouped GEMM on the tokens
sorted by expert. qlayers rewrites no module's code; `QuantTunixMoE` is the
drop-in that runs the same math the Megablox path does (route with the
wide ``router``, sort the token copies by expert, ``silu(x @ gate) * (x @
up) @ down`` per expert, sum the copies with the routing weights), each of
its three grouped GEMMs a `qlayers.layers.QuantRaggedDot` (every expert's
GEMMs, forward and backward, quantized with its own scales; for a delayed
recipe one amax history per expert and weight). It holds the very
``router``, ``gate_proj``, ``up_proj`` and ``down_proj`` of the layer it
replaces, so names, shapes and sharding metadata are unchanged and Tunix's
checkpoint loaders still apply. `qlayers.integrations.tunix.quantize`
swaps it in; the router stays wide.

One path on every platform: the dispatch is `qlayers.expert_parallel`'s
single-program sort, not Tunix's ``shard_map`` over an expert axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import expert_parallel, swap
from qlayers.layers.core import QuantLayer
from qlayers.layers.experts import QuantRaggedDot
from qlayers.recipe import Recipe

__all__ = ["QuantTunixMoE", "is_tunix_moe", "check"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_tunix_moe(m) -> bool:
  """Whether ``m`` is the ``MoELayer`` of Tunix's Qwen3 (a ``router`` and
  the stacked ``gate_proj`` / ``up_proj`` / ``down_proj`` Params of its
  experts; its math as of google-tunix 0.1.7). Other families' MoE layers
  (Gemma 4's ``MoERagged``) differ and are not matched."""
  return (type(m).__name__ == "MoELayer"
          and type(m).__module__.startswith("tunix.models.qwen3")
          and isinstance(getattr(m, "experts_per_tok", None), int)
          and isinstance(getattr(m, "router", None), nnx.Linear)
          and all(isinstance(getattr(m, p, None), nnx.Param)
                  and getattr(m, p).ndim == 3 for p in PROJECTIONS))


def check(layer, recipe: Recipe) -> tuple[int, int]:
  """``(D, F)`` of Tunix ``MoELayer`` ``layer`` if its expert GEMMs take
  ``recipe``, else raises `qlayers.swap.Skip`."""
  _, d, f = layer.gate_proj.shape
  block, gran = swap.min_block(recipe)
  if min(d, f) < block:
    raise swap.Skip(f"D={d}, F={f}: smaller than one {block}-element {gran} "
                    f"scaling block of recipe {recipe.name!r}")
  return d, f


class QuantTunixMoE(QuantLayer, nnx.Module):
  """Tunix's ``MoELayer`` with its expert GEMMs quantized (see the module).

  Holds what Tunix's does under the same names: ``router`` (an
  ``nnx.Linear``, ``D -> E``, kept wide), ``gate_proj`` and ``up_proj``
  ``[E, D, F]``, ``down_proj [E, F, D]`` (Params, initialised as Tunix
  does), ``num_experts``, ``experts_per_tok``, ``dtype``; plus
  ``gate_quant``, ``up_quant`` and ``down_quant``, the `QuantRaggedDot` of
  each stacked weight (``quant`` is ``gate_quant``: the three share recipe
  and backend). Inputs are cast to ``dtype``; the weights are quantized from
  their stored (FP32 master) values.

  The grouped GEMMs work on per-expert buffers (`qlayers.ragged`): ``E``
  times the token copies' bytes, as Tunix's own loop off TPU. With
  ``capacity_factor`` (a settable attribute) each expert takes at most
  ``ceil(capacity_factor * copies / E)`` token copies (the buffers shrink to
  that; copies past it are dropped: output 0, no gradient); default
  ``None``: none dropped, the layer's exact math.

  Args:
    num_experts: ``E``.
    embed_dim: ``D``.
    hidden_dim: ``F``, each expert's hidden width.
    experts_per_tok: the experts each token goes to (top k).
    rngs: initialises the Params.
    dtype, param_dtype: computation and Param dtypes.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).
    capacity_factor: see above (default ``None``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlayers.integrations.tunix_moe import QuantTunixMoE
    >>> moe = QuantTunixMoE(4, 32, 64, experts_per_tok=2,
    ...                     recipe="fp8_current", rngs=nnx.Rngs(0))
    >>> nnx.jit(lambda m, x: m(x))(moe, jnp.ones((2, 3, 32))).shape
    (2, 3, 32)
    >>> jax.tree.map(jnp.shape, nnx.state(moe, nnx.Param)).down_proj
    Param(
      value=(4, 64, 32)
    )
  """

  def __init__(self, num_experts: int, embed_dim: int, hidden_dim: int, *,
               experts_per_tok: int, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32, recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None,
               capacity_factor: float | None = None):
    self.router = nnx.Linear(embed_dim, num_experts, use_bias=False,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    init = nnx.initializers.normal(dtype=param_dtype)
    up = (num_experts, embed_dim, hidden_dim)
    self.gate_proj = nnx.Param(init(rngs.params(), up))
    self.up_proj = nnx.Param(init(rngs.params(), up))
    self.down_proj = nnx.Param(init(rngs.params(),
                                    (num_experts, hidden_dim, embed_dim)))
    self.num_experts = num_experts
    self.experts_per_tok = experts_per_tok
    self.dtype = dtype
    self.capacity_factor = capacity_factor
    for p in PROJECTIONS:
      quant = QuantRaggedDot(recipe, num_groups=num_experts, backend=backend)
      quant.seed_from(getattr(self, p)[...])
      setattr(self, p.replace("_proj", "_quant"), quant)

  @classmethod
  def from_tunix(cls, layer, recipe: Recipe | str, *,
                 backend: str | None = None,
                 capacity_factor: float | None = None) -> "QuantTunixMoE":
    """The drop-in for Tunix ``MoELayer`` ``layer``, holding its very
    ``router`` and Params (and its other attributes, ``shd_config``)."""
    new = cls(1, 1, 1, experts_per_tok=1, rngs=nnx.Rngs(0), recipe=recipe,
              backend=backend, capacity_factor=capacity_factor)
    for name, value in vars(layer).items():
      if not name.startswith("_"):
        setattr(new, name, value)
    for p in PROJECTIONS:
      quant = QuantRaggedDot(recipe, num_groups=layer.num_experts,
                             backend=backend)
      quant.seed_from(getattr(layer, p)[...])
      setattr(new, p.replace("_proj", "_quant"), quant)
    return new

  @property
  def quant(self) -> QuantRaggedDot:
    """The GEMM of ``gate_proj`` (its recipe and backend are all three's)."""
    return self.gate_quant

  @property
  def gemm_dims(self) -> tuple[int, int]:
    """``(K, N)`` of its first GEMM (``gate_proj``): ``(D, F)``."""
    return tuple(self.gate_proj.shape[1:])

  def __call__(self, x: jax.Array, use_megablox: bool = True) -> jax.Array:
    """``x [B, T, D] -> [B, T, D]``; ``use_megablox`` is accepted for
    Tunix's signature (one path either way)."""
    del use_megablox
    dtype = self.dtype or x.dtype
    scores = self.router(x).astype(jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(scores, axis=-1),
                                 self.experts_per_tok)
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)
               ).astype(dtype)
    tokens = jnp.reshape(x, (-1, x.shape[-1])).astype(dtype)
    n = tokens.shape[0]
    xs, sizes, route = expert_parallel.dispatch(
        tokens, jnp.reshape(ids, (n, -1)), n_experts=self.num_experts)
    cap = (None if self.capacity_factor is None else max(1, math.ceil(
        self.capacity_factor * xs.shape[0] / self.num_experts)))

    def gemm(q, a, w):  # quantized from the FP32 master, as QuantExperts
      return q.ragged(a, w[...], sizes, out_dtype=dtype, capacity=cap)
    h = (nnx.silu(gemm(self.gate_quant, xs, self.gate_proj))
         * gemm(self.up_quant, xs, self.up_proj))
    ys = gemm(self.down_quant, h, self.down_proj)
    y = expert_parallel.combine(ys, route, jnp.reshape(weights, (n, -1)))
    return jnp.reshape(y, x.shape[:-1] + y.shape[-1:]).astype(dtype)
