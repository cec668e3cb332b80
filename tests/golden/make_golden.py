"""Records qlayers' outputs, gradients and state for every named recipe.

Run from the repository root to (re)write ``tests/golden/golden.npz``::

  .venv/bin/python tests/golden/make_golden.py [RECIPE ...]

(with recipe names, only their entries are rewritten)

`tests/test_golden.py` recomputes the same values and compares them (state
bit for bit, GEMM results to within the host's summation order): the
evidence that a refactoring changed no numerics. Only
the public API is used (QuantDense, QuantEinsum, qlayers.value_and_grad,
qlayers.Optimizer, qlayers.ops), on small shapes.

The values are XLA:CPU's under the suite's flags (`_support.xla_flags`,
backend optimizations off): the rounding of the test's loss,
``sum(y * cos(y))``, and its gradient depends on them, and the gradient's
amax is compared bit for bit.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _support import xla_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

xla_flags.apply()  # before JAX starts its backend

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import qlayers
from qlayers import ops

PATH = pathlib.Path(__file__).with_name("golden.npz")
K, N = 64, 32


def _loss(y):
  y = y.astype(jnp.float32)
  return jnp.sum(y * jnp.cos(y))


def _flat(prefix: str, state) -> dict[str, np.ndarray]:
  out = {}
  for path, v in nnx.to_flat_state(state):
    value = v.get_value() if isinstance(v, nnx.Variable) else v
    out[prefix + "/".join(map(str, path))] = np.asarray(value)
  return out


def _layer(name: str) -> dict[str, np.ndarray]:
  """QuantDense: forward, input/kernel/bias gradients, then params and
  quantization state after 3 optimizer steps."""
  x = jax.random.normal(jax.random.key(1), (2, 5, K)) * 2
  model = qlayers.QuantDense(K, N, recipe=name, rngs=nnx.Rngs(0))
  out = {}

  @nnx.jit
  def dx_of(model, x):
    return nnx.grad(lambda x, m: _loss(m(x)))(x, nnx.clone(model))

  with warnings.catch_warnings():  # x alone is differentiated here
    warnings.simplefilter("ignore")
    out["dense/dx"] = np.asarray(dx_of(model, x))
  opt = qlayers.Optimizer(model, optax.adam(1e-2))

  @nnx.jit
  def step(model, opt, x):
    (_, y), grads = qlayers.value_and_grad(
        lambda m: (_loss(m(x)), m(x)), has_aux=True)(model)
    opt.update(model, grads)
    return y, grads

  for i in range(3):
    y, grads = step(model, opt, x * (1 + i))
    if i == 0:
      out["dense/y"] = np.asarray(y)
      out.update(_flat("dense/grad/", grads))
  out.update(_flat("dense/param/", nnx.state(model, nnx.Param)))
  out.update(_flat("dense/qstate/", nnx.state(model, qlayers.QuantVariable)))
  return out


def _ops(name: str) -> dict[str, np.ndarray]:
  """ops.quantized_matmul (and ops.dot_general for stateless recipes):
  output, new state and the vjp of x, w (and the gradient amax)."""
  recipe = qlayers.recipe(name)
  x = jax.random.normal(jax.random.key(2), (3, K))
  w = jax.random.normal(jax.random.key(3), (K, N)) * 0.1
  state = ops.init_state(recipe)
  out = {}

  def f(x, w, state):
    return ops.quantized_matmul(x, w, recipe, state)

  (y, new_state), vjp = jax.vjp(jax.jit(f), x, w, state)
  g = jnp.cos(y)
  dx, dw, dstate = vjp((g, jax.tree.map(jnp.zeros_like, new_state)))
  out["ops/y"], out["ops/dx"], out["ops/dw"] = map(np.asarray, (y, dx, dw))
  if state is not None:
    out["ops/g_amax"] = np.asarray(dstate["g"].amax)
    for role, st in new_state.items():
      out[f"ops/state/{role}"] = np.asarray(st.amax)
    return out
  dg = ops.dot_general(recipe)
  # Jitted: one compile, not one per op of the quantize and the Hadamard
  # stages (equal to the eager values up to summation order).
  y2, grads = jax.jit(jax.value_and_grad(
      lambda x, w: _loss(jnp.einsum("mk,kn->mn", x, w, _dot_general=dg)),
      argnums=(0, 1)))(x, w)
  out["dot_general/loss"] = np.asarray(y2)
  out["dot_general/dx"], out["dot_general/dw"] = map(np.asarray, grads)
  einsum = qlayers.QuantEinsum("btd,dnh->btnh", (K, 2, 8), (2, 8),
                               recipe=recipe, rngs=nnx.Rngs(4))
  out["einsum/y"] = np.asarray(nnx.jit(lambda m, x: m(x))(einsum,
                                                         x.reshape(1, 3, K)))
  return out


def compute(names=None) -> dict[str, np.ndarray]:
  """``{recipe/what: array}`` for the recipes ``names`` (default: every
  recipe of `available_recipes`)."""
  out = {}
  for name in names or qlayers.available_recipes():
    for part in (_layer(name), _ops(name)):
      out.update({f"{name}/{k}": v for k, v in part.items()})
  return out


if __name__ == "__main__":
  # Recipe names as arguments: rewrite only their entries (a change meant
  # to move those recipes' numerics), keeping every other recorded value.
  names = sys.argv[1:]
  unknown = set(names) - set(qlayers.available_recipes())
  if unknown:
    raise SystemExit(f"unknown recipes: {sorted(unknown)}")
  data = {}
  if names:
    data = {k: v for k, v in np.load(PATH).items()
            if k.split("/", 1)[0] not in names}
  data.update(compute(names))
  np.savez_compressed(PATH, **data)
  print(f"{PATH}: {len(data)} arrays, {PATH.stat().st_size} bytes")
