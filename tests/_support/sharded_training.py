"""Small models, layouts and a compiled train step for the sharding tests.

Imported by the multi-device subprocess scripts (``sharding_*_cases.py``),
never by the suite's own process. A layout names a mesh, the batch's spec and
the specs of the kernels; `train` compiles one step (so its HLO can be read)
and runs it a few times.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import qlayers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] /
                       "benchmarks"))
import collectives  # noqa: E402  pylint: disable=g-import-not-at-top

D, H = 64, 256          # MLP width, hidden (MX: K a multiple of 32)
BATCH, SEQ = 32, 8      # 256 tokens: 32 per device on 8 (an MX block)
LR = 1e-2

# name -> (mesh shape, axis names, batch spec, kernel specs, bias specs)
LAYOUTS = {
    "dp": ((8,), ("data",), P("data"),
           {"up": P(None, None), "down": P(None, None)}, {}),
    "fsdp": ((8,), ("fsdp",), P("fsdp"),
             {"up": P("fsdp", None), "down": P("fsdp", None)}, {}),
    "tp": ((2, 4), ("data", "model"), P("data"),
           {"up": P(None, "model"), "down": P("model", None)},
           {"up": P("model")}),
    "fsdp_tp": ((2, 4), ("fsdp", "model"), P("fsdp"),
                {"up": P("fsdp", "model"), "down": P("model", "fsdp")},
                {"up": P("model")}),
}


def mesh_for(layout: str, explicit: bool = False):
  shape, names, *_ = LAYOUTS[layout]
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


class MLP(nnx.Module):
  """Two quantized layers; ``layout`` puts sharding metadata on the Params."""

  def __init__(self, recipe, *, rngs, layout=None, backend=None,
               param_dtype=jnp.float32):
    def meta(kind, name):
      if layout is None:
        return {}
      specs = LAYOUTS[layout][3 if kind == "kernel" else 4]
      spec = specs.get(name)
      return {} if spec is None else {"out_sharding": tuple(spec)}
    common = dict(recipe=recipe, backend=backend, rngs=rngs,
                  param_dtype=param_dtype, dtype=param_dtype)
    self.up = qlayers.QuantDense(D, H, kernel_metadata=meta("kernel", "up"),
                                 bias_metadata=meta("bias", "up"), **common)
    self.down = qlayers.QuantDense(H, D,
                                   kernel_metadata=meta("kernel", "down"),
                                   bias_metadata=meta("bias", "down"),
                                   **common)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def mse(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(BATCH, SEQ, D)).astype(np.float32)
  y = rng.normal(size=(BATCH, SEQ, D)).astype(np.float32)
  return x, y


def _path(path) -> str:
  """``"up/kernel"`` of a pytree path (a Variable's value attribute left
  out)."""
  names = []
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        names.append(k.name)
    else:
      names.append(str(getattr(k, "key", getattr(k, "idx", k))))
  return "/".join(names)


def place(tree, mesh, layout: str):
  """Auto-axes placement by hand (``jax.device_put``): kernels, biases and
  everything that mirrors them (moments, masters) by the layout's specs,
  everything else replicated."""
  _, _, _, kernels, biases = LAYOUTS[layout]

  def spec_for(name, v):
    if not np.size(v):  # a zero-size marker (no master needed)
      return P()
    for layer, spec in kernels.items():
      if name.endswith(f"{layer}/kernel") and v.ndim == len(spec):
        return spec
    for layer, spec in biases.items():
      if name.endswith(f"{layer}/bias") and v.ndim == len(spec):
        return spec
    return P()

  return jax.tree_util.tree_map_with_path(
      lambda p, v: jax.device_put(v, NamedSharding(mesh, spec_for(_path(p),
                                                                    v))),
      tree)


def optimizer(model, kind="qlayers"):
  if kind == "qlayers":
    return qlayers.Optimizer(model, optax.adam(LR))
  return nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)


def compile_step(model, opt, x, y, loss_fn=mse):
  """(compiled step, state): ``step(state, x, y) -> (loss, state)``."""
  graphdef, state = nnx.split((model, opt))
  stock = not isinstance(opt, qlayers.Optimizer)

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = qlayers.value_and_grad(loss_fn)(model, x, y)
    with jax.numpy_dtype_promotion("standard"):  # optax under strict rules
      opt.update(model, grads)
    if stock:
      qlayers.update_scales(model, grads)
    return loss, nnx.state((model, opt))

  out_shardings = None
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and AxisType.Explicit not in mesh.axis_types:
    # Auto axes: the state comes back laid out as it went in, so the one
    # compiled step serves every call.
    out_shardings = (None, jax.tree.map(lambda a: a.sharding, state))
  step = jax.jit(step, out_shardings=out_shardings)
  return step.lower(state, x, y).compile(), state


def train(model, opt, x, y, steps=3, loss_fn=mse):
  """Losses of ``steps`` steps and the step's optimized HLO text."""
  compiled, state = compile_step(model, opt, x, y, loss_fn)
  losses = []
  for _ in range(steps):
    loss, state = compiled(state, x, y)
    losses.append(float(loss))
  nnx.update((model, opt), state)
  return losses, compiled.as_text()


def quant_state(model) -> dict[str, list]:
  """Every quantization state array as a list (exact comparison)."""
  flat = nnx.to_flat_state(nnx.state(model, qlayers.QuantVariable))
  return {"/".join(map(str, p)): np.asarray(v.get_value()).tolist()
          for p, v in flat}


def specs(tree) -> dict[str, str]:
  """``{path: spec}`` of the arrays of an nnx state."""
  out = {}
  for path, v in jax.tree_util.tree_leaves_with_path(nnx.as_pure(tree)):
    sharding = getattr(v, "sharding", None)
    out[_path(path)] = str(getattr(sharding, "spec", None))
  return out


def summary(hlo: str) -> dict:
  return collectives.summary(hlo)
