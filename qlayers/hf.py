"""Loading Hugging Face tensors (`qlayers.checkpoint.read_safetensors`) into
a model, FP8 weights as frozen quantized kernels.

Hugging Face names are the model's business, so the caller maps them:
``names`` takes a Variable's dotted path in the model (``"blocks.0.mlp.
up_proj.kernel"``) to a tensor name (``"model.layers.0.mlp.up_proj.
weight"``). Linear weights are stored ``(out, in)``, kernels are ``(in,
out)``: a 2-D tensor loaded into a 2-D ``kernel`` is transposed (an
einsum's kernel only where its contracted dim leads: one stored ``(out,
in)``, ``"bd,fd->bf"``, loads as it is); N-D kernels see `load_tensors`.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax.numpy as jnp
from flax import nnx

from qlayers.layers.frozen import (FrozenKernel, contracted_dims,
                                    kernel_sharding, settle_delayed)
from qlayers.scaling import QTensor

__all__ = ["load_tensors"]


def _module_at(model, path: str):
  """The module at dotted ``path`` (attributes, list indices, dict keys),
  by any of its paths (a layer shared under two names has both); None
  where there is none."""
  node = model
  for part in path.split(".") if path else ():
    child = getattr(node, part, None)
    if child is None and hasattr(node, "__getitem__"):
      for key in ((int(part), part) if part.isdigit() else (part,)):
        try:
          child = node[key]
          break
        except (KeyError, IndexError, TypeError):
          continue
    if child is None:
      return None
    node = child
  return node if isinstance(node, nnx.Module) else None


def load_tensors(model: nnx.Module, tensors: Mapping[str, object],
                 names: Mapping[str, str], *, frozen: bool = True) -> int:
  """Sets the Variables of ``model`` named by ``names`` (model path ->
  tensor name) from ``tensors``, in place; returns how many.

  A `QTensor` (an FP8 weight read with ``quantized=True``) loaded into a
  ``kernel`` becomes a `qlayers.FrozenKernel` holding its payload and scales
  as they are (``frozen=True``: no FP32 master), or the exactly dequantized
  weight (``frozen=False``). Everything else is converted to the Variable's
  dtype; shapes must match (after the kernel transpose). A 2-D ``(out, in)``
  tensor loads into an N-D kernel of a layer with ``in_features``
  (``nnx.LinearGeneral``, `qlayers.QuantAttentionProj`'s projections:
  ``(in..., out...)`` flattened to ``(in, out)``) or of an einsum whose
  contracted dims lead its kernel. An einsum kernel with them elsewhere
  (``"bd,fd->bf"``) takes the tensor as it is, its shape, dequantized (it
  is not frozen, as `qlayers.freeze` leaves it). Every name is checked
  before anything changes.

  Example:
    >>> import tempfile, numpy as np
    >>> from flax import nnx
    >>> import qlayers
    >>> from qlayers import checkpoint
    >>> d = checkpoint.write_safetensors(tempfile.mkdtemp(), {
    ...     "fc.weight": np.ones((128, 256), np.float32),
    ...     "fc.bias": np.zeros(128, np.float32)})
    >>> layer = qlayers.QuantDense(256, 128, rngs=nnx.Rngs(0))
    >>> load_tensors(layer, checkpoint.read_safetensors(d, quantized=True),
    ...              {"kernel": "fc.weight", "bias": "fc.bias"})
    2
    >>> type(layer.kernel).__name__, float(layer.kernel[...].mean())
    ('FrozenKernel', 1.0)
  """
  todo, bad = [], []
  for path, name in names.items():
    owner, _, attr = path.rpartition(".")
    module = _module_at(model, owner)
    var = getattr(module, attr, None) if module is not None else None
    if name not in tensors:
      bad.append(f"{path}: no tensor {name!r}")
      continue
    if not isinstance(var, (nnx.Variable, FrozenKernel)):
      bad.append(f"{path}: no such Variable in the model")
      continue
    t = tensors[name]
    n_in = _inputs(module, var) if attr == "kernel" and len(t.shape) == 2 \
        else None
    kernel = n_in is not None
    shape = (_flat(var.shape, n_in)[::-1] if kernel else tuple(var.shape))
    if shape != tuple(t.shape):
      bad.append(f"{path}: model {tuple(var.shape)}, tensor {name!r} "
                 f"{tuple(t.shape)}" + (" (transposed)" if kernel else ""))
      continue
    todo.append((module, attr, var, t, n_in))
  if bad:
    raise ValueError("load_tensors: " + "; ".join(bad) + ".")
  for module, attr, var, t, n_in in todo:
    if isinstance(t, QTensor) and n_in is not None and frozen:
      setattr(module, attr, FrozenKernel.from_qtensor(
          t, tuple(var.shape), n_in=n_in, dtype=_dtype(var),
          sharding=(var.sharding if isinstance(var, FrozenKernel)
                    else kernel_sharding(var))))
      settle_delayed(module)
      continue
    x = t.dequantize() if isinstance(t, QTensor) else jnp.asarray(t)
    x = x.T.reshape(var.shape) if n_in is not None else x
    if isinstance(var, FrozenKernel):
      var.requantize(x.astype(jnp.float32))
      settle_delayed(module)
    else:
      var.set_value(jnp.asarray(x, _dtype(var)))
      if attr in ("kernel", "embedding"):
        settle_delayed(module)
  return len(todo)


def _inputs(module, var) -> int | None:
  """How many leading (input) dims of kernel ``var`` a 2-D ``(out, in)``
  tensor flattens: 1 for a 2-D kernel, the layer's input features for an
  N-D one (``nnx.LinearGeneral``, `qlayers.QuantAttentionProj`'s
  projections), an einsum's contracted dims where they lead its kernel;
  None where the layer does not say, or an einsum's kernel has them
  elsewhere (``"bd,fd->bf"`` is stored ``(out, in)`` already: the tensor
  loads as it is)."""
  if isinstance(var, FrozenKernel):  # a stack's: one tensor per layer
    return None if var.stack else var.n_in
  if len(var.shape) == 2 and not isinstance(module, nnx.Einsum):
    return 1
  try:
    return contracted_dims(module, "load_tensors")
  except (AttributeError, ValueError):  # no features; a batched kernel, a
    return None  # stack, an einsum that is not one GEMM


def _flat(shape, n_in: int) -> tuple[int, int]:
  return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def _dtype(var):
  return var.dtype if isinstance(var, FrozenKernel) else var.get_value().dtype
