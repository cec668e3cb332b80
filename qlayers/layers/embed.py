"""QuantEmbed: an ``nnx.Embed`` whose tied output head (``attend``) is
quantized."""

from __future__ import annotations

import jax
from flax import nnx

from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.layers.dense import check_last_dim
from qlayers.recipe import Recipe

__all__ = ["QuantEmbed"]


class QuantEmbed(QuantLayer, nnx.Embed):
  """``nnx.Embed`` whose ``attend`` (logits against the table, a tied output
  head) runs as a quantized GEMM; the lookup ``__call__`` is unchanged.

  Same constructor and Params (``embedding (num_embeddings, features)``) as
  ``nnx.Embed``. ``attend(query)`` computes ``query @ embedding.T`` through
  the `QuantGemm` at ``quant``, quantizing the table from its stored value,
  with gradients flowing into the table. `qlayers.quantize` makes one only
  when a rule with a recipe explicitly matches the embedding's path (output
  heads are kept wide by default); `qlayers.QuantLogits` (``embed=...``) is
  the other way to a quantized tied head.

  Args:
    num_embeddings: vocabulary size.
    features: embedding width.
    recipe: the recipe of the ``attend`` GEMM (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).
    **kwargs: everything ``nnx.Embed`` takes (``dtype``, ``param_dtype``,
      ``embedding_init``, ``rngs``, ...).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> from qlayers.layers import QuantEmbed
    >>> emb = QuantEmbed(100, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> x = emb(jnp.array([[1, 2, 3]]))
    >>> x.shape, emb.attend(x).shape
    ((1, 3, 32), (1, 3, 100))
  """

  def __init__(self, num_embeddings: int, features: int, *,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, **kwargs):
    super().__init__(num_embeddings, features, **kwargs)
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self.embedding[...])

  def attend(self, query: jax.Array, out_sharding=None) -> jax.Array:
    """Logits ``(..., num_embeddings)`` of ``query (..., features)``."""
    table = self.embedding[...]
    check_last_dim(f"{type(self).__name__}.attend", query, table.shape[-1],
                   "queries")
    query, _ = self.promote_dtype((query, table), dtype=self.dtype)
    return self.quant.matmul(query, table.T, out_sharding=out_sharding)
