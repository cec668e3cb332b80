"""Differentiation that carries gradient-side quantization state exactly.

`value_and_grad` is a drop-in for ``nnx.value_and_grad`` on a model with
quantized layers. It differentiates the Params (``wrt``) and, in the same
pass, collects every layer's gradient amax (`QuantGradState`) from the
backward rule. A layer used several times in a step (tied weights, a loop)
combines its uses by max, not sum: each use reads the gradient amax the
previous one passed through (`qlayers.QuantGemm.write`), so the uses form a
chain whose backward rules take the max (`qlayers.gemm`); JAX never adds
two of them. Inside ``nnx.scan`` that holds for a layer in the carry, not
for one broadcast (``in_axes=None``): scan sums a broadcast input's
cotangents and drops the body's writes to it. The state stays plain FP32,
which orbax saves, and
``nnx.value_and_grad(..., argnums=nnx.DiffState(0, (nnx.Param,
qlayers.QuantGradState)))`` combines it the same way.

Like ``nnx.value_and_grad`` it compiles nothing itself: called eagerly it
runs op by op (and reads closures and globals afresh on every call); put the
training step under ``nnx.jit`` for speed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers.fields import positive_int
from qlayers.layers.frozen import FrozenWeight
from qlayers.state import QuantGradState, QuantVariable

__all__ = ["value_and_grad", "grad", "accumulate_grads", "average_grads"]


def value_and_grad(f: Callable[..., Any], argnums: int = 0, *,
                   has_aux: bool = False, wrt=nnx.Param,
                   loss_scale: jax.Array | float | None = None):
  """Like ``nnx.value_and_grad(f, argnums, has_aux=...)`` for quantized models.

  Returns ``(value, grads)`` (``((value, aux), grads)`` with ``has_aux``)
  where ``grads`` is an ``nnx.State`` with the gradients of the ``wrt``
  Variables of the model at ``argnums`` plus, at each `QuantGradState`
  path, the gradient amax of this step (`qlayers.Optimizer` writes it, or
  `qlayers.update_scales`).
  Other state the model mutates in ``f`` (forward quantization state, batch
  statistics, RNG counters) is written back to the model, as with NNX, and
  so is what ``f`` writes to the other NNX objects among its arguments (an
  ``nnx.Rngs``, a teacher model), which are not differentiated.

  Args:
    f: the loss function; its ``argnums`` argument is the model.
    argnums: position of the model argument (an int).
    has_aux: ``f`` returns ``(loss, aux)``.
    wrt: filter of the Variables to differentiate (default ``nnx.Param``).
    loss_scale: multiply the seed cotangent by this (FP16 loss scaling; the
      returned value is not scaled, the gradients are). ``None``: 1. The
      scale is a cotangent of the loss, in its dtype: a float16 loss
      cannot carry one above 65504 (2**16 is Inf there, such a step is
      skipped and a dynamic scale backs off), so compute the loss in
      float32 to let the scale grow past 2**15.

  Called eagerly it runs op by op, as ``nnx.value_and_grad`` does; a fast
  training step is one the caller wraps in ``nnx.jit``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(8, 4, recipe="fp8_delayed",
    ...                            rngs=nnx.Rngs(0))
    >>> vg = qlayers.value_and_grad(lambda m, x: jnp.sum(m(x)))
    >>> loss, grads = vg(layer, jnp.ones((2, 8)))
    >>> sorted(grads.keys())
    ['bias', 'kernel', 'quant']
  """
  if not isinstance(argnums, int):
    raise TypeError("qlayers.value_and_grad differentiates one model: "
                    f"argnums must be an int, got {argnums!r}.")

  @functools.wraps(f)
  def value_and_grad_fn(*args, **kwargs):
    if len(args) <= argnums or not isinstance(args[argnums], nnx.Module):
      got = type(args[argnums]).__name__ if len(args) > argnums else "nothing"
      raise TypeError(f"Argument {argnums} must be an nnx.Module, got {got}.")
    return _value_and_grad(f, argnums, has_aux, wrt, loss_scale, args, kwargs)

  return value_and_grad_fn


def _value_and_grad(f, argnums, has_aux, wrt, loss_scale, args, kwargs):
  model = args[argnums]
  check_wrt(model, wrt, "qlayers.value_and_grad")
  # The model and the other NNX objects among the arguments (an nnx.Rngs, a
  # second model), split together (a Variable they share stays one) and
  # merged inside the differentiated function: what ``f`` writes to them is
  # written back, as nnx.value_and_grad does. Only the model's ``wrt``
  # Variables and gradient amaxes are differentiated.
  is_node = nnx.graph.is_graph_node
  nodes = (model, {i: a for i, a in enumerate(args)
                   if i != argnums and is_node(a)},
           {k: v for k, v in kwargs.items() if is_node(v)})
  filters = (nnx.All(wrt, _in_model), nnx.All(QuantGradState, _in_model), ...)
  graphdef, *typed = nnx.split(nodes, *filters)
  diff, qgrad, rest = nnx.as_pure(typed)

  def inner(diff, qgrad):
    merged = nnx.merge(graphdef, diff, qgrad, rest)
    m, arg_nodes, kw_nodes = merged
    a = [arg_nodes.get(i, x) for i, x in enumerate(args)]
    a[argnums] = m
    out = f(*a, **{**kwargs, **kw_nodes})
    loss, aux = out if has_aux else (out, None)
    *_, new_rest = nnx.split(merged, *filters)
    return loss, (aux, nnx.as_pure(new_rest))

  loss, vjp_fn, (aux, new_rest) = jax.vjp(inner, diff, qgrad, has_aux=True)
  if isinstance(loss, (tuple, list, dict)):
    raise TypeError(f"qlayers.value_and_grad: the loss function returned a "
                    f"{type(loss).__name__}, not a scalar; for (loss, aux) "
                    "pass has_aux=True.")
  if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss),
                                                 jnp.floating):
    raise TypeError(f"qlayers.value_and_grad: the loss must be a real "
                    f"scalar (as for jax.grad), got shape {jnp.shape(loss)} "
                    f"{jnp.result_type(loss)}.")
  seed = jnp.ones_like(loss)
  if loss_scale is not None:
    seed = seed * jnp.asarray(loss_scale, loss.dtype)
  g_diff, g_q = vjp_fn(seed)
  nnx.update(nodes, new_rest)
  grads = nnx.merge_state(_typed(typed[0], g_diff), _typed(typed[1], g_q))
  return ((loss, aux) if has_aux else loss), grads.get(0, nnx.State({}))


def _in_model(path, _) -> bool:
  """Whether a Variable's path is in the model (``nodes[0]``)."""
  return path[0] == 0


def check_wrt(model: nnx.Module, wrt, where: str) -> None:
  """Refuses a ``wrt`` filter that takes quantization state (its values are
  written by the layers and `qlayers.update_scales`) or a frozen kernel's
  codes and scales: never differentiated or run through an optimizer (that
  silently corrupts them)."""
  for kind, what in ((QuantVariable, "quantization state"),
                     (FrozenWeight, "frozen kernels' codes and scales")):
    taken = nnx.state(model, nnx.All(wrt, kind))
    if jax.tree.leaves(taken):
      paths = [".".join(map(str, p))
               for p, _ in nnx.to_flat_state(taken)][:3]
      raise ValueError(
          f"{where}: wrt={wrt!r} takes {what} ({', '.join(paths)}, ...); "
          "differentiate and optimize the Params only (the default "
          "wrt=nnx.Param; nnx.LoRAParam for adapters).")


def _typed(template: nnx.State, values) -> nnx.State:
  """``values`` (pure arrays) as Variables of the types in ``template``."""
  return jax.tree.map(lambda v, x: v.replace(x), template, values,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


def grad(f: Callable[..., Any], argnums: int = 0, *, has_aux: bool = False,
         wrt=nnx.Param, loss_scale=None):
  """`value_and_grad` returning only the gradients (and aux)."""
  vg = value_and_grad(f, argnums, has_aux=has_aux, wrt=wrt,
                      loss_scale=loss_scale)

  @functools.wraps(f)
  def wrapper(*args, **kwargs):
    out, grads = vg(*args, **kwargs)
    return (grads, out[1]) if has_aux else grads

  return wrapper


def accumulate_grads(total: nnx.State | None, grads: nnx.State) -> nnx.State:
  """Adds micro-batch gradients: Params sum, gradient amaxes combine by max.

  Start with ``total=None``. Floating gradients are summed in at least FP32
  (BF16 partial sums would lose the micro-batches' low bits), so a total of
  BF16 gradients is FP32. If the loss is a mean, divide the total with
  `average_grads`: dividing every leaf would divide the gradient amaxes too,
  and the next steps' gradients would saturate.
  """
  for name, s in (("total", total), ("grads", grads)):
    if not (isinstance(s, nnx.State) or (name == "total" and s is None)):
      raise TypeError(f"accumulate_grads(total, grads): {name} must be an "
                      f"nnx.State of gradients, got {type(s).__name__}.")
  if total is None:
    return jax.tree.map(_wide, grads)
  qt, pt = nnx.split_state(total, QuantGradState, ...)
  qg, pg = nnx.split_state(grads, QuantGradState, ...)
  return nnx.merge_state(jax.tree.map(lambda a, b: _wide(a) + _wide(b),
                                      pt, pg),
                         jax.tree.map(jnp.maximum, qt, qg))


def average_grads(total: nnx.State, n: int) -> nnx.State:
  """``total`` (from `accumulate_grads`) with its Params' gradients divided
  by ``n``, the number of micro-batches; the gradient amaxes are kept.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlayers.state import QuantGradState
    >>> g = nnx.State({"w": nnx.Param(jnp.ones(2) * 4),
    ...                "g_amax": QuantGradState(jnp.float32(3))})
    >>> out = average_grads(g, 2)
    >>> out["w"][...].tolist(), float(out["g_amax"][...])
    ([2.0, 2.0], 3.0)
  """
  if not isinstance(total, nnx.State):
    raise TypeError(f"average_grads(total, n): total must be an nnx.State "
                    f"of gradients, got {type(total).__name__}.")
  n = positive_int(n, "average_grads: n")
  amaxes, rest = nnx.split_state(total, QuantGradState, ...)
  return nnx.merge_state(jax.tree.map(lambda g: g / n, rest), amaxes)


def _wide(g: jax.Array) -> jax.Array:
  """``g`` in at least FP32 if it is floating."""
  if not jnp.issubdtype(g.dtype, jnp.floating):
    return g
  return g if jnp.finfo(g.dtype).bits >= 32 else g.astype(jnp.float32)
