"""LoRA adapters beside (frozen) quantized base weights.

`add_lora` puts an ``nnx.LoRA`` (``nnx.LoRAParam`` ``lora_a (K, r)``,
``lora_b (r, N)``, BF16 by default) at ``layer.lora`` of each
`qlayers.QuantDense`, `qlayers.QuantLinearGeneral` and `qlayers.QuantEinsum`
(the projections of `qlayers.QuantAttentionProj` too), whose output then
adds ``x @ lora_a @ lora_b`` over the GEMM's flattened ``K`` and ``N`` (the
state names of ``nnx.LoRALinear``). The base GEMM stays quantized; the
adapter GEMMs run in the adapters' dtype. Train the adapters only with
``wrt=nnx.LoRAParam`` (`qlayers.value_and_grad`, `qlayers.Optimizer`, or
``nnx.DiffState(0, nnx.LoRAParam)``); with `qlayers.freeze` the base has no
Param at all.

`save_adapters` / `load_adapters` keep only the adapters (one safetensors
file); `merge_lora` folds them into the base (requantizing a frozen kernel
in its own format) for export with `qlayers.checkpoint.write_safetensors`.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import warnings
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers import safetensors
from qlayers import swap
from qlayers import swap_experts
from qlayers.fields import positive_int
from qlayers.layers.core import QuantLayer, hand_made
from qlayers.layers.dense import QuantDense
from qlayers.layers.frozen import (FrozenKernel, check_finite, check_key,
                                    contracted_dims, layer_stack,
                                    settle_delayed)
from qlayers.layers.general import QuantEinsum, QuantLinearGeneral

__all__ = ["add_lora", "lora_layers", "merge_lora", "save_adapters",
           "load_adapters"]


def _path(path) -> str:
  return ".".join(map(str, path))


_ADAPTABLE = (QuantDense, QuantLinearGeneral, QuantEinsum)


def lora_layers(model: nnx.Module) -> Iterator[tuple[tuple, nnx.Module]]:
  """Every layer of ``model`` with an adapter, with its path."""
  for path, node in nnx.iter_graph(model):
    if (isinstance(node, _ADAPTABLE)
        and getattr(node, "lora", None) is not None):
      yield path, node


def _gemm_dims(layer) -> tuple[tuple[int, ...], int, int] | None:
  """``(stack, K, N)`` of the GEMM an adapter sits beside: the dims of a
  stack of layers (``nnx.vmap``; ``()`` for one layer), and of each
  layer's kernel the leading (contracted) dims and the rest; None where
  the contracted dims of an einsum's kernel do not lead."""
  n_in = contracted_dims(layer, "add_lora", stacks=True)
  if n_in is None:
    return None
  stack = layer_stack(layer)
  shape = tuple(layer.kernel.shape)[len(stack):]
  return stack, math.prod(shape[:n_in]), math.prod(shape[n_in:])


def add_lora(model: nnx.Module, rank: int, *, rngs: nnx.Rngs,
             param_dtype=jnp.bfloat16, dtype=None,
             where: Callable[[str], bool] | str | re.Pattern | None = None
             ) -> int:
  """Adds an ``nnx.LoRA`` adapter of rank ``rank`` at ``.lora`` of every
  `qlayers.QuantDense`, `qlayers.QuantLinearGeneral` and `qlayers.QuantEinsum`
  in ``model`` (those ``where`` accepts: a function of the dotted path,
  ``"blocks.0.mlp"``, or a regular expression searched in the path joined
  by ``/``, as a `qlayers.Rule`'s pattern is), in place; returns how
  many.

  ``lora_a`` is initialised by ``nnx.LoRA`` (He uniform) and ``lora_b`` to
  zero, so the model's outputs do not change until it trains. ``dtype``: the
  adapter GEMMs' dtype (default ``param_dtype``). A layer that has one
  keeps it. A quantized layer that cannot take one (an einsum whose kernel
  does not lead with its contracted dims, the experts' grouped GEMMs, a tied embedding) is named in a warning; a model
  with no quantized layer (where ``where`` accepts) is a ValueError. A
  stack of layers made under ``nnx.vmap`` gets a stack of adapters (each
  layer its own ``lora_a``, drawn on its own), which ``nnx.scan`` over the
  stack hands each layer as it hands it its kernel.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="fp8_current",
    ...                            rngs=nnx.Rngs(0))
    >>> _ = qlayers.freeze(layer)
    >>> qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
    1
    >>> {k: v.shape for k, v in nnx.to_flat_state(
    ...     nnx.state(layer, nnx.LoRAParam))}
    {('lora', 'lora_a'): (64, 4), ('lora', 'lora_b'): (4, 32)}
  """
  rank = positive_int(rank, "rank")
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"add_lora: rngs must be an nnx.Rngs (the adapters' "
                    f"initialisation), got {type(rngs).__name__}.")
  if isinstance(where, (str, re.Pattern)):
    pattern = re.compile(where)
    def where(dotted: str) -> bool:  # as a Rule matches: the /-joined path
      return bool(pattern.search(dotted.replace(".", "/")))
  elif where is not None and not callable(where):
    raise TypeError(f"where must be a function of the dotted path or a "
                    f"regular expression, got {where!r}.")
  # A layer held under several paths (shared, tied) is taken where
  # ``where`` accepts any of them, as a Rule decides it.
  paths = {id(s.layer): [p.replace("/", ".") for p in s.paths]
           for s in swap.sites(model, lambda m: isinstance(m, QuantLayer),
                               root=True)}
  found = [(_path(p), n) for p, n in nnx.iter_graph(model)
           if isinstance(n, QuantLayer) and (where is None or any(
               map(where, paths[id(n)])))]
  todo = []
  refused = [f"{p} (a stock layer running a QuantGemm)"
             for p in (p.replace("/", ".") for p in hand_made(model))
             if where is None or where(p)]
  refused += [f"{s.path.replace('/', '.') or '(model)'} (experts: a "
              "grouped GEMM)" for s in swap_experts.sites(model)
              if swap_experts.is_quantized(s.layer) and (where is None or any(
                  where(p.replace("/", ".")) for p in s.paths))]
  for path, node in found:
    dims = _gemm_dims(node) if isinstance(node, _ADAPTABLE) else None
    if dims is None:
      refused.append(f"{path or '(model)'} ({type(node).__name__})")
    elif getattr(node, "lora", None) is None:
      todo.append((node, dims))
  if not found:
    hand = (f"; {', '.join(refused)}: adapters go beside qlayers layers "
            "(QuantDense, or a stock layer that qlayers.quantize converts)"
            if refused else "")
    raise ValueError("add_lora found no quantized layer to adapt" + (
        " that `where` accepts" if where is not None else "" if refused
        else " (quantize the model first: qlayers.quantize)") + hand + ".")
  if refused:
    warnings.warn(
        f"add_lora left without an adapter: {', '.join(refused)} (it takes "
        "QuantDense, QuantLinearGeneral and QuantEinsum layers whose kernel "
        "leads with its contracted dims); pass where= to leave them out "
        "and silence this.", stacklevel=2)
  for node, (stack, k, n) in todo:
    node.lora = _adapter(stack, k, rank, n, dtype=dtype or param_dtype,
                         param_dtype=param_dtype, rngs=rngs)
  return len(todo)


def _adapter(stack: tuple[int, ...], k: int, rank: int, n: int, *,
             rngs: nnx.Rngs, **kw) -> nnx.LoRA:
  """An ``nnx.LoRA`` of one layer, or (``stack``) one per stacked layer
  made under ``nnx.vmap``, its Params' stack dims flattened by it and
  restored here."""
  if not stack:
    return nnx.LoRA(k, rank, n, rngs=rngs, **kw)

  @nnx.split_rngs(splits=math.prod(stack))
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(rngs):
    return nnx.LoRA(k, rank, n, rngs=rngs, **kw)

  lora = make(rngs)
  for var in (lora.lora_a, lora.lora_b):
    var.set_value(var.get_value().reshape(*stack, *var.shape[1:]))
  return lora


def _merged(node) -> jax.Array:
  """``node``'s kernel plus its adapter's ``lora_a @ lora_b``, in FP32."""
  lora = node.lora
  delta = (lora.lora_a[...].astype(jnp.float32)  # per stacked layer
           @ lora.lora_b[...].astype(jnp.float32))
  kernel = (node.kernel.dequantize(jnp.float32)
            if isinstance(node.kernel, FrozenKernel)
            else node.kernel[...].astype(jnp.float32))
  return kernel + delta.reshape(node.kernel.shape)


def merge_lora(model: nnx.Module, *, key: jax.Array | None = None) -> int:
  """Folds each adapter into its layer's kernel and removes it, in place:
  ``kernel + lora_a @ lora_b`` (in FP32), a frozen kernel requantized in
  its own format (`qlayers.FrozenKernel.requantize`; ``key``: a PRNG key,
  needed where that format rounds stochastically); returns how many.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, rngs=nnx.Rngs(0))
    >>> _ = qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
    >>> qlayers.merge_lora(layer), hasattr(layer, "lora")
    (1, False)
  """
  found = list(lora_layers(model))
  check_key("merge_lora", [  # before any is merged: nothing half-done
      "/".join(map(str, p)) or type(n).__name__ for p, n in found
      if isinstance(n.kernel, FrozenKernel) and n.kernel.spec.stochastic],
            key)
  # Checked before any is merged (nothing half-done), made again to merge:
  # one merged FP32 kernel held at a time.
  check_finite("merge_lora", (
      ("/".join(map(str, p)) or type(n).__name__, _merged(n))
      for p, n in found))
  for i, (_, node) in enumerate(found):
    if isinstance(node.kernel, FrozenKernel):
      node.kernel.requantize(
          _merged(node),
          key=None if key is None else jax.random.fold_in(key, i))
    else:
      node.kernel[...] = _merged(node).astype(node.kernel.dtype)
    settle_delayed(node)
    del node.lora
  left = sorted(_adapters(model))
  if left:
    warnings.warn(
        f"merge_lora left adapters it does not fold: {', '.join(left)} "
        "(it folds those qlayers.add_lora put beside qlayers layers; "
        "those of qlayers.integrations.tunix.add_lora: its merge_lora).",
        stacklevel=2)
  return len(found)


def _adapters(model) -> dict[str, nnx.Variable]:
  return {_path(p): v for p, v in nnx.to_flat_state(
      nnx.state(model, nnx.LoRAParam))}


def save_adapters(path: str | os.PathLike, model: nnx.Module
                  ) -> pathlib.Path:
  """Writes only the ``nnx.LoRAParam`` values of ``model`` to the
  safetensors file ``path`` (names: dotted module paths), exactly.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, rngs=nnx.Rngs(0))
    >>> _ = qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
    >>> f = save_adapters(tempfile.mkdtemp() + "/lora.safetensors", layer)
    >>> sorted(load_adapters(f, layer))
    ['lora.lora_a', 'lora.lora_b']
  """
  tensors = {name: np.asarray(v.get_value())
             for name, v in _adapters(model).items()}
  if not tensors:
    raise ValueError("The model has no nnx.LoRAParam to save (see "
                     "qlayers.add_lora).")
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  safetensors.write_file(path, tensors)
  return path


def load_adapters(path: str | os.PathLike, model: nnx.Module) -> list[str]:
  """Loads the adapters `save_adapters` wrote into ``model`` (same names,
  shapes and dtypes, else ValueError listing the differences, and nothing
  changes); returns their names."""
  saved = safetensors.read_file(pathlib.Path(path))
  target = _adapters(model)
  bad = sorted(set(saved) ^ set(target))
  bad = [f"{n}: only in {'the file' if n in saved else 'the model'}"
         for n in bad]
  for name in sorted(set(saved) & set(target)):
    want = target[name].get_value()
    got = saved[name]
    if got.shape != want.shape or got.dtype != want.dtype:
      bad.append(f"{name}: file {got.dtype}{list(got.shape)}, model "
                 f"{want.dtype}{list(want.shape)}")
  if bad:
    raise ValueError(f"{path}: adapters do not match the model: "
                     + "; ".join(bad) + ".")
  state = nnx.state(model, nnx.LoRAParam)
  for p, var in nnx.to_flat_state(state):
    var.set_value(jnp.asarray(saved[_path(p)]))
  nnx.update(model, state)
  return sorted(target)
