"""Finding the linear layers of an NNX model and swapping them in place.

The mechanics behind `qlayers.quantize` and `qlayers.dequantize_model`, on
public Flax functions only: `nnx.iter_graph` lists the nodes,
`nnx.iter_children` the modules a node holds (plain lists, dicts and tuples
are read as Python containers), and a layer is replaced by ``setattr`` on its
parent module or item assignment on a list, dict, ``nnx.List`` or
``nnx.Dict``. A tuple cannot be changed in place, so a layer held in one is
reported, not swapped.

The drop-in is built through its own constructor with size-1 features and
zero initialisers (a few bytes of throwaway Params, no random numbers) and
then takes the original's attributes, so it holds the very same Variables.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers.layers.core import injected_op, QuantGemm, QuantLayer
from qlayers.layers.dense import QuantDense
from qlayers.layers.embed import QuantEmbed
from qlayers.layers.experts import (QuantExperts, QuantExpertsEinsum,
                                    QuantRaggedDot, expert_einsum)
from qlayers.layers.general import (QuantEinsum, QuantLinearGeneral,
                                    einsum_gemm_plan)
from qlayers.recipe import Recipe

STOCK = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
QUANT_OF = {nnx.Linear: QuantDense, nnx.LinearGeneral: QuantLinearGeneral,
            nnx.Einsum: QuantEinsum, nnx.Embed: QuantEmbed}
STOCK_OF = {q: s for s, q in QUANT_OF.items()} | {
    QuantExpertsEinsum: nnx.Einsum}
QUANT_ATTRS = ("quant",)  # what a drop-in adds to the stock layer


class Skip(Exception):
  """A layer that cannot be swapped; the message says why."""


@dataclasses.dataclass
class Site:
  """A layer, its first path, and every ``(parent, key, path)`` holding it."""

  path: str
  layer: nnx.Module
  refs: list

  @property
  def paths(self) -> tuple[str, ...]:
    """Every path of the layer, its first one first."""
    return (self.path, *(p for _, _, p in self.refs if p != self.path))


def path_str(path) -> str:
  return "/".join(str(p) for p in path)


def _children(node):
  """``(key, child)`` for the modules and containers ``node`` holds."""
  if isinstance(node, (list, tuple)):
    return list(enumerate(node))
  if isinstance(node, dict):
    return list(node.items())
  if isinstance(node, nnx.Module):
    return list(nnx.iter_children(node))
  return []


def sites(model: nnx.Module, want, root: bool = False) -> list[Site]:
  """Every module ``want`` accepts (the model itself too if ``root``: a
  swap of one of its attributes), sorted by path, with all the places that
  reference it (a shared layer has several)."""
  found: dict[int, Site] = {}
  nodes = list(nnx.iter_graph(model))
  for path, node in nodes:
    if (path or root) and isinstance(node, nnx.Module) and want(node):
      found.setdefault(id(node), Site(path_str(path), node, []))
  for path, node in nodes:
    for key, child in _children(node):
      site = found.get(id(child))
      if site is not None and site.layer is child:
        site.refs.append((node, key, path_str(path + (key,))))
  return sorted(found.values(), key=lambda s: s.path)


def immutable_ref(site: Site) -> str | None:
  """Why ``site`` cannot be swapped (a tuple holds it), or None."""
  for parent, _, path in site.refs:
    if isinstance(parent, tuple):
      return (f"referenced at {path} from an immutable "
              f"{type(parent).__name__}; hold it in a list or nnx.List")
  return None


def replace(site: Site, new: nnx.Module) -> None:
  """Puts ``new`` everywhere ``site``'s layer was."""
  for parent, key, _ in site.refs:
    if isinstance(parent, (list, dict, nnx.List, nnx.Dict)):
      parent[key] = new
    else:
      setattr(parent, key, new)


def adopt(new: nnx.Module, old: nnx.Module, skip=()) -> nnx.Module:
  """Gives ``new`` the public attributes (and so the Variables) of ``old``.

  ``new`` was built by the same constructor family, so it already has each
  attribute with the same data/static status; ``setattr`` keeps that status.
  """
  for name, value in vars(old).items():
    if not name.startswith("_") and name not in skip:
      setattr(new, name, value)
  return new


def dims(layer) -> tuple[int, int]:
  """``(K, N)`` of the GEMM a (stock or quantized) layer runs."""
  if isinstance(layer, nnx.Embed):  # its attend: query @ embedding.T
    return layer.features, layer.num_embeddings
  if isinstance(layer, nnx.Linear):
    return layer.in_features, layer.out_features
  if isinstance(layer, nnx.LinearGeneral):
    return math.prod(layer.in_features), math.prod(layer.out_features)
  if isinstance(layer, QuantExperts):
    return layer.in_features, layer.out_features
  if hasattr(layer, "gemm_dims"):  # a block of several GEMMs: its first's
    return layer.gemm_dims
  eq, shape = layer.einsum_str, layer.kernel_shape
  if experts_einsum(layer):  # one GEMM per expert: its (K, N)
    eq, shape = eq.replace(expert_einsum(eq), ""), shape[1:]
  try:
    _, rhs, _, contracted, free = einsum_gemm_plan(eq)
  except ValueError:
    return 0, 0
  size = dict(zip(rhs, shape))
  return (math.prod(size[c] for c in contracted),
          math.prod(size[c] for c in free))


def experts_einsum(layer) -> bool:
  """An ``nnx.Einsum`` batched over its kernel's leading index, the experts
  (`qlayers.layers.experts.expert_einsum`): it becomes a
  `QuantExpertsEinsum`."""
  if not isinstance(layer, nnx.Einsum) or layer.einsum_op is not jnp.einsum:
    return False
  try:
    expert_einsum(layer.einsum_str)
  except ValueError:
    return False
  return True


def one_gemm(layer) -> int:
  """Raises `Skip` unless ``layer`` is one plain GEMM; returns kernel rank."""
  if isinstance(layer, nnx.Embed):
    return 2
  op = injected_op(layer)
  if op is not None:
    raise Skip(f"a custom {op} is injected; replacing the layer would drop "
               "it")
  if isinstance(layer, nnx.Linear):
    return 2
  if isinstance(layer, nnx.LinearGeneral):
    if layer.batch_axis:
      raise Skip(f"batch_axis={dict(layer.batch_axis)} makes it a batched "
                 "GEMM (one weight per batch entry)")
    return len(layer.in_features) + len(layer.out_features)
  try:
    _, rhs, *_ = einsum_gemm_plan(layer.einsum_str)
  except ValueError as e:
    raise Skip(str(e)) from None
  return len(rhs)


def min_block(recipe: Recipe) -> tuple[int, str]:
  """Largest scaling block along K or N of the Fprop/Dgrad operands."""
  best = (1, "")
  for gemm in (recipe.fprop, recipe.dgrad):
    for spec in (gemm.lhs, gemm.rhs):
      if spec is not None and spec.granularity in ("tile", "block", "mx"):
        best = max(best, (spec.block_size, spec.granularity))
  return best


def check(layer, recipe: Recipe) -> tuple[int, int]:
  """``(K, N)`` if ``layer`` can take ``recipe``, else raises `Skip`."""
  if type(layer) not in QUANT_OF:
    base = next(t for t in QUANT_OF if isinstance(layer, t))
    raise Skip(f"a subclass of nnx.{base.__name__}, whose behaviour the "
               "drop-in would not keep")
  if not experts_einsum(layer):
    one_gemm(layer)
  k, n = dims(layer)
  block, gran = min_block(recipe)
  if min(k, n) < block:
    raise Skip(f"K={k}, N={n}: smaller than one {block}-element {gran} "
               f"scaling block of recipe {recipe.name!r} (mostly padding; "
               "block-scaled GEMM kernels reject it)")
  return k, n


def weight(layer):
  """The Variable (or `qlayers.FrozenKernel`) holding ``layer``'s matmul
  weight: ``embedding``, ``kernel``, or a Tunix drop-in's ``w``; None for a
  layer of experts (``QuantTunixMoE``)."""
  if isinstance(layer, nnx.Embed):
    return layer.embedding
  kernel = getattr(layer, "kernel", None)
  return kernel if kernel is not None else getattr(layer, "w", None)


def _zero_init(key, shape, dtype):
  del key
  return np.zeros(shape, dtype)


def _twin(cls, layer, **quant) -> nnx.Module:
  """``cls`` built with size-1 features and ``layer``'s structure."""
  if issubclass(cls, nnx.Embed):
    return cls(1, 1, embedding_init=_zero_init, rngs=nnx.Rngs(0), **quant)
  kw = dict(kernel_init=_zero_init, bias_init=_zero_init,
            rngs=nnx.Rngs(0), **quant)
  if issubclass(cls, nnx.Linear):
    return cls(1, 1, use_bias=layer.use_bias, **kw)
  if issubclass(cls, nnx.LinearGeneral):
    return cls((1,) * len(layer.in_features), (1,) * len(layer.out_features),
               axis=layer.axis, use_bias=layer.use_bias, **kw)
  bias = None if layer.bias_shape is None else (1,) * len(layer.bias_shape)
  return cls(layer.einsum_str, (1,) * len(layer.kernel_shape), bias, **kw)


def quantized(layer, recipe: Recipe, backend: str | None) -> nnx.Module:
  """The drop-in of stock ``layer``, holding its Variables."""
  if experts_einsum(layer):
    new = adopt(_twin(QuantExpertsEinsum, layer, recipe=recipe,
                      backend=backend), layer)
    w = layer.kernel
    stack = tuple(w.shape[:len(w.shape) - len(layer.kernel_shape)])
    new.quant = QuantRaggedDot(recipe, num_groups=layer.kernel_shape[0],
                               backend=backend, stack=stack)
    return new
  new = adopt(_twin(QUANT_OF[type(layer)], layer, recipe=recipe,
                    backend=backend), layer)
  w = weight(layer)
  stack = tuple(w.shape[:len(w.shape) - one_gemm(layer)])
  if stack and (recipe.delayed or recipe.sr_key == "step"):
    # Made under nnx.vmap: one delayed-scaling state and one rounding
    # seed and counter per stacked layer.
    new.quant = QuantGemm(recipe, backend=backend, batch_shape=stack)
  return new


def stock(layer) -> nnx.Module:
  """The stock layer a drop-in came from, holding its Params."""
  return adopt(_twin(STOCK_OF[type(layer)], layer), layer, skip=QUANT_ATTRS)


def is_quantized(m) -> bool:
  return isinstance(m, QuantLayer)


def is_gemm(m) -> bool:
  """A module `qlayers.quantize` looks at: a stock linear layer, an
  embedding (its tied ``attend``) or a layer already quantized."""
  return isinstance(m, (*STOCK, nnx.Embed)) or is_quantized(m)


# Stock layers whose rank-2 Params are not matmul weights (stacked norms).
_NOT_MATMUL = (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm,
               nnx.InstanceNorm, nnx.Embed, QuantGemm, QuantLayer, *STOCK)


def unconverted_matmuls(model, table_name, experts=()
                        ) -> list[tuple[str, str, str]]:
  """``(path, type, why)`` of modules that own a matmul weight (a Param of
  rank >= 2, not named like a lookup table) but are no layer `quantize`
  converts, so they are not passed over silently. Normalisation layers are
  not listed (stacked under ``nnx.vmap`` their scales have rank 2), nor the
  modules in ``experts`` (ids of the experts modules `quantize` decided)."""
  out = []
  for path, node in nnx.iter_graph(model):
    if (not isinstance(node, nnx.Module) or isinstance(node, _NOT_MATMUL)
        or id(node) in experts):
      continue
    weights = [(k, v) for k, v in vars(node).items()
               if isinstance(v, nnx.Param) and np.ndim(v.get_value()) >= 2
               and not table_name.search(k)]
    if not weights:
      continue
    name, var = weights[0]
    shape = tuple(np.shape(var.get_value()))
    if len(shape) == 3 and not isinstance(node, nnx.Conv):
      why = (f"not converted: stacked expert weights {name!r} {shape} used "
             "by its own code (jax.lax.ragged_dot or an einsum), which "
             "qlayers does not rewrite: hold the grouped GEMM as "
             "self.ragged_dot = jax.lax.ragged_dot (quantize then swaps it "
             "for a qlayers.layers.QuantRaggedDot) or build the experts "
             "from qlayers.QuantExperts")
    elif isinstance(node, nnx.Conv):
      why = ("not converted: a convolution (qlayers quantizes the GEMMs of "
             "nnx.Linear, nnx.LinearGeneral and nnx.Einsum)")
    else:
      why = (f"not converted: not a recognised linear layer (it owns the "
             f"Param {name!r} of shape {shape}); build it from nnx.Linear, "
             "or run its matmul through qlayers.QuantGemm, which takes "
             "lax.dot_general's arguments")
    out.append((path_str(path) or "(model)", type(node).__name__, why))
  return out
