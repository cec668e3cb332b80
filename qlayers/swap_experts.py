"""Finding the stacked experts of a mixture-of-experts model and quantizing
their grouped GEMM in place (the MoE part of `qlayers.quantize`).

qlayers swaps layers, never code: a module that calls ``jax.lax.ragged_dot``
from its own ``__call__`` cannot be reached. What it can reach is the way
``nnx.Linear`` takes ``dot_general``: an *experts module* holds its grouped
GEMM as an attribute, ``self.ragged_dot = jax.lax.ragged_dot``, next to a
stacked kernel ``nnx.Param [E, K, N]`` (``kernel``, or its only rank-3
Param; ``[*stack, E, K, N]`` for a stack of such modules made under
``nnx.vmap``, which a router near it stacked alike confirms). `quantize`
sets that attribute to a `QuantRaggedDot` (recipe, backend, one
delayed-scaling history per expert and stacked layer) and leaves the
module, its Params and its code as they were; `dequantize` puts
``jax.lax.ragged_dot`` back. The router of such experts (the linear layer
nearest them mapping their ``K`` inputs to ``E`` scores) is kept wide.
Stacked expert weights used any other way are reported with what to do
(`swap.unconverted_matmuls`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from qlayers import swap
from qlayers.layers.core import QuantLayer
from qlayers.layers.experts import QuantRaggedDot
from qlayers.recipe import Recipe

__all__ = ["is_experts", "is_experts_layer", "is_quantized", "sites",
           "check", "quantize", "dequantize", "dims", "routers", "stacks"]

ATTR = "ragged_dot"  # the attribute holding an experts module's grouped GEMM


def is_experts(m) -> bool:
  """An experts module: it holds its grouped GEMM at ``ragged_dot``."""
  return (isinstance(m, nnx.Module) and not isinstance(m, QuantLayer)
          and ATTR in vars(m) and callable(vars(m)[ATTR]))


def is_experts_layer(m) -> bool:
  """A layer of experts whose router is kept wide too: a qlayers layer
  whose GEMM is grouped (a `QuantRaggedDot` at ``quant``: `QuantExperts`,
  `QuantExpertsEinsum`, ``QuantTunixMoE``), or an ``nnx.Einsum`` batched
  over its kernel's leading (expert) dim, such as ``"ecd,edf->ecf"``."""
  if isinstance(m, QuantLayer):
    return isinstance(getattr(m, "quant", None), QuantRaggedDot)
  return swap.experts_einsum(m)


def is_quantized(m) -> bool:
  return is_experts(m) and isinstance(vars(m)[ATTR], QuantRaggedDot)


def sites(model: nnx.Module) -> list[swap.Site]:
  """Every experts module of ``model``, with its path and references."""
  return swap.sites(model, is_experts, root=True)


def _stacked(m) -> dict[str, tuple[int, ...]]:
  """The shapes of ``m``'s stacked weights by name: Params of rank >= 3
  and of its kernel's rank (a stacked bias ``[*stack, E, N]`` is not one),
  the weights its grouped GEMM may multiply by."""
  shapes = {k: tuple(np.shape(v.get_value())) for k, v in vars(m).items()
            if isinstance(v, nnx.Param) and np.ndim(v.get_value()) >= 3}
  rank = len(shapes["kernel"]) if "kernel" in shapes else max(
      map(len, shapes.values()), default=0)
  return {k: v for k, v in shapes.items() if len(v) == rank}


def _kernel(m) -> tuple[str, tuple[int, ...]] | None:
  """``(name, shape)`` of the stacked kernel ``[*stack, E, K, N]`` (the
  stack: layers made under ``nnx.vmap``): ``kernel`` if it is a Param of
  rank >= 3, else the only such Param of the highest rank, else None."""
  stacked = _stacked(m)
  if "kernel" in stacked:
    return "kernel", stacked["kernel"]
  return next(iter(stacked.items())) if len(stacked) == 1 else None


def _near(e: swap.Site, linear: list[swap.Site], fits) -> list[swap.Site]:
  """The linear layers of ``linear`` that ``fits`` accepts nearest to
  experts module ``e``, where its router would be: beside it (children of
  the module holding it) or in it; else one module down from there (a
  router wrapped in a module of its own); else beside the module holding
  it (a router beside a container of experts, as Mixtral's gate beside its
  ``experts``). Never further: a block's other layers (attention's gates)
  may map the same widths."""
  parent = e.path.rpartition("/")[0]
  def depth_below(path, top):  # 1: a child of top; 0: not under it
    if top and not path.startswith(top + "/"):
      return 0
    return path[len(top):].strip("/").count("/") + 1
  levels = (lambda p: depth_below(p, parent) == 1 or depth_below(p, e.path)
            == 1,
            lambda p: depth_below(p, parent) == 2,
            lambda p: bool(parent) and depth_below(
                p, parent.rpartition("/")[0]) == 1)
  candidates = [s for s in linear if s.path
                and isinstance(s.layer, (nnx.Linear, nnx.LinearGeneral))
                and fits(s.layer)]
  for level in levels:
    found = [s for s in candidates if level(s.path)]
    if found:
      return found
  return []


def stacks(linear: list[swap.Site], experts: list[swap.Site]) -> set[int]:
  """Ids of the experts modules of ``experts`` whose kernel has dims before
  ``[E, K, N]`` that are a stack of layers made under ``nnx.vmap``: a
  router near them (`_near`) has a kernel ``[*stack, D, E]`` with the same
  leading dims. Einsum experts declare their kernel's shape, so their stack
  is known without one."""
  out = set()
  for e in experts:
    found = _kernel(e.layer)
    if found is None:
      continue
    shape = found[1]
    if len(shape) == 3 or isinstance(e.layer, nnx.Einsum):
      out.add(id(e.layer))
      continue
    def fits(layer, shape=shape):
      k = getattr(layer, "kernel", None)
      return (isinstance(k, nnx.Variable) and len(k.shape) == len(shape) - 1
              and tuple(k.shape[:-2]) == shape[:-3]
              and k.shape[-1] == shape[-3])
    if _near(e, linear, fits):
      out.add(id(e.layer))
  return out


def check(m, recipe: Recipe, stacked: bool = False) -> tuple[int, int]:
  """``(K, N)`` if experts module ``m`` can take ``recipe``, else raises
  `swap.Skip`; ``stacked``: a kernel of rank > 3 is a stack (`stacks`)."""
  if vars(m)[ATTR] is not jax.lax.ragged_dot:
    raise swap.Skip(f"a custom {ATTR} is injected; replacing it would drop "
                    "it")
  weights = _stacked(m)
  if len(weights) > 1 and (recipe.delayed or recipe.sr_key == "step"):
    # One QuantRaggedDot for several weights: one amax history (rounding
    # seed) for all, each weight scaled by the others' amaxes.
    state = "delayed-scaling" if recipe.delayed else "rounding"
    raise swap.Skip(
        f"holds several stacked weights ({', '.join(weights)}) that its one "
        f"{ATTR} would serve with one {state} state; recipe {recipe.name!r} "
        "keeps state per GEMM, so give each weight an experts module of its "
        f"own (its kernel and its {ATTR}), or use a recipe without it "
        "(fp8_current, mxfp8)" + ("" if "kernel" in weights else
                                  ", naming one of them 'kernel'"))
  found = _kernel(m)
  if found is None:
    raise swap.Skip(f"holds {ATTR} but no single stacked kernel nnx.Param "
                    "[E, K, N] (name it 'kernel')")
  if len(found[1]) > 3 and not stacked:
    raise swap.Skip(
        f"kernel {found[1]} has dims before [E, K, N], and no router near "
        "it stacked alike (kernel [*stack, D, E]) shows them to be a stack "
        "of layers made under nnx.vmap")
  block, gran = swap.min_block(recipe)
  for name, (*_, k, n) in weights.items():  # any of them may be multiplied
    if min(k, n) < block:
      raise swap.Skip(f"{name + ': ' if len(weights) > 1 else ''}K={k}, "
                      f"N={n}: smaller than one "
                      f"{block}-element {gran} scaling block of recipe "
                      f"{recipe.name!r}")
  return found[1][-2:]


def dims(m) -> tuple[int, int]:
  """``(K, N)`` of an experts module's stacked kernel."""
  return _kernel(m)[1][-2:]


def quantize(m, recipe: Recipe, backend: str | None) -> QuantRaggedDot:
  """Puts a `QuantRaggedDot` for ``recipe`` at ``m.ragged_dot``; returns it."""
  *stack, experts, _, _ = _kernel(m)[1]
  gemm = QuantRaggedDot(recipe, num_groups=experts, backend=backend,
                        stack=tuple(stack))
  setattr(m, ATTR, nnx.data(gemm))
  return gemm


def dequantize(m) -> None:
  """Puts ``jax.lax.ragged_dot`` back (the state is dropped)."""
  setattr(m, ATTR, nnx.static(jax.lax.ragged_dot))


def routers(linear: list[swap.Site], experts: list[swap.Site],
            stacked: set[int] = frozenset()) -> dict[int, str]:
  """``{id(layer): why}`` for the routers of ``experts``: the linear
  layers nearest an experts module (`_near`) that map its experts' input
  features to their ``E`` scores (``stacked``: the ids
  `stacks` gives, whose kernels' leading dims are a stack)."""
  out = {}
  for e in experts:
    num, k = _count_and_features(e.layer, id(e.layer) in stacked)
    if not isinstance(num, int):
      continue
    def fits(layer):
      return swap.dims(layer)[1] == num and k in (None, swap.dims(layer)[0])
    for s in _near(e, linear, fits):
      out.setdefault(id(s.layer), f"router of the {num} experts at "
                     f"{e.path or '(model)'} (kept wide)")
  return out


def _count_and_features(m, stacked: bool) -> tuple[int | None, int | None]:
  """``(E, K)`` of experts module or layer ``m``: how many experts, and the
  input features each takes (None where it does not say)."""
  if isinstance(m, nnx.Einsum):  # batched over its kernel's leading dim
    return m.kernel_shape[0], swap.dims(m)[0]
  found = _kernel(m) if is_experts(m) else None
  if found and (len(found[1]) == 3 or stacked):
    return found[1][-3], found[1][-2]
  k = swap.dims(m)[0] if isinstance(m, QuantLayer) else None
  return getattr(m, "num_experts", None), k
