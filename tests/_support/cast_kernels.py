"""Shared helpers of the cast-kernel tests (tests/test_cast_transpose_*.py):
bit patterns, sample data with every special value, and a recipe's matmul
run paired for a GPU target in Pallas' interpreter."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import qlayers
from qlayers import cast_transpose as ct
from qlayers import hadamard
from qlayers import ops
from qlayers import table


def bits(a):
  """Bit patterns, every NaN as one (E5M2 has several NaN codes; an Inf
  times zero is -NaN on x86 and +NaN on GPUs)."""
  a = np.asarray(a)
  u = a.view(np.dtype(f"u{a.dtype.itemsize}"))
  return np.where(np.isnan(a.astype(np.float32)), np.iinfo(u.dtype).max, u)


# Jitted: one compile per shape, where eager calls compile each of the
# butterfly's stages (a few ops each) one by one.
transform = jax.jit(hadamard.transform, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(0, 1))  # one compile, not seven
def data(shape, dtype):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 300.0
  # NaN, +-Inf, overflow past the format's max, values rounding to zero and
  # to subnormals, ties of the multiplier.
  x = x.at[0, 0].set(jnp.nan).at[1, 3].set(jnp.inf).at[2, 5].set(-jnp.inf)
  x = x.at[3, 7].set(-1e30).at[4, 9].set(1e-12).at[5, 11].set(3e-4)
  return x.astype(dtype)


def spec(name="fp8_current"):
  return qlayers.recipe(name).fprop.lhs


def paired_against_unpaired(monkeypatch, recipe, arch, kernel, record):
  """(unpaired, paired) value and gradients of a ``recipe`` matmul, the
  paired one traced for ``arch`` with every pair's CUDA branch taken and
  ``cast_transpose.<kernel>`` run in Pallas' interpreter on CPU;
  ``record(t, args, kw)`` sees each of its calls."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1

  def loss(x, w):
    y, _ = ops.quantized_matmul(x, w, recipe)
    return jnp.sum(y * jnp.cos(y))

  # Jitted: one compile each, where eager calls compile every op one by
  # one. The kernels' calls are recorded as the paired one is traced.
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(x, w)
  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  original = getattr(ct, kernel)

  def interpreted(t, *args, **kw):
    record(t, args, kw)
    return original(t, *args, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, kernel, interpreted)
  with table.target_arch(arch):
    got = jax.jit(grad)(x, w)
  return want, got


def frozen_lora_dgrad_under(mesh, recipe: str, n: int = 512) -> dict:
  """A LoRA step's input gradient on a frozen ``recipe`` kernel (256 -> n)
  under ``mesh`` (one axis, "fsdp"; auto or explicit), its codes and
  scales sharded along K and x's rows over the mesh, planned for B200:
  how many requantize calls (`qlayers.cast_transpose.mx_requantize`,
  `nvfp4_requantize`) its CUDA lowering holds, and whether it keeps the
  single-device gradient on CPU."""
  import re  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  layer = qlayers.QuantDense(256, n, recipe=recipe, rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
  graph, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32)

  def dx(state, x):  # nnx.grad: NVFP4's rounding counter is state
    return nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=1)(
        nnx.merge(graph, state), x)

  def place(path, a):
    name = jax.tree_util.keystr(path)
    along_k = ("payload" in name or "scale" in name) and a.ndim == 2
    return jax.device_put(a, NamedSharding(
        mesh, P(None, "fsdp") if along_k and a.shape[1] % 8 == 0 else P()))

  with table.target_arch("sm_100"):
    want = jax.jit(dx)(state, x)
    with jax.set_mesh(mesh):
      args = (jax.tree_util.tree_map_with_path(place, state),
              jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
      got = jax.jit(dx)(*args)
      text = jax.jit(dx).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
  # jax 0.10 prints `func.call @f(`, jax 0.12 `call @f(`.
  return {"requantize_calls": len(re.findall(
      r"\bcall @(mx|nvfp4)_requantize\(", text)),
          "same_bits": bool(np.array_equal(np.asarray(got),
                                           np.asarray(want)))}
