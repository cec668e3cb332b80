"""Backend selection and the xla backend's paths."""

import jax
import jax.numpy as jnp
import pytest

import qlayers
from qlayers import dispatch
from qlayers import scaling as S
from numerics import sqnr_db


def test_scaled_dot_matches_emulation():
  spec = S.QuantSpec(format="e4m3", granularity="mx")
  x = jax.random.normal(jax.random.key(0), (64, 96))
  w = jax.random.normal(jax.random.key(1), (96, 40))
  a, b = S.quantize(x, spec, 1), S.quantize(w, spec, 0)
  emulated = dispatch.xla_gemm(a, b, jnp.float32, (1, 0))
  native = jax.jit(lambda a, b: dispatch.scaled_dot_mx(a, b, jnp.float32))(
      a, b)
  assert sqnr_db(emulated, native) > 120


def test_forced_backend_errors(monkeypatch):
  spec = S.QuantSpec(format="e4m3")
  a = S.quantize(jnp.ones((4, 32)), spec, 1)
  b = S.quantize(jnp.ones((32, 8)), spec, 0)
  with pytest.raises(ValueError, match="Unknown backend 'tpu'"):
    dispatch.select(a, b, "tpu")
  monkeypatch.setenv("QLAYERS_BACKEND", "nope")
  with pytest.raises(ValueError, match="QLAYERS_BACKEND"):
    dispatch.select(a, b)
  monkeypatch.setenv("QLAYERS_BACKEND", "xla")
  assert dispatch.select(a, b) == ("xla", "forced")


def test_gemm_checks_operands():
  spec = S.QuantSpec(format="e4m3")
  a = S.quantize(jnp.ones((4, 32)), spec, 1)
  with pytest.raises(TypeError, match="both be QTensor"):
    dispatch.gemm(a, jnp.ones((32, 8)), axes=(1, 0), out_dtype=jnp.float32)
  b = S.quantize(jnp.ones((32, 8)), spec, 0)
  with pytest.raises(ValueError, match="quantized along axes"):
    dispatch.gemm(a, b, axes=(1, 1), out_dtype=jnp.float32)


def test_report_names_platform_and_backends():
  info = qlayers.backends()
  assert info["platform"] == jax.default_backend()
  assert info["available"]["xla"] is True


def test_report_says_what_each_recipe_uses():
  chosen = qlayers.backends()["chosen"]
  assert set(qlayers.available_recipes()) == set(chosen)
  assert chosen["bf16"]["backend"] == "xla"
  for name, c in chosen.items():
    assert c["backend"] in ("xla", "ffi") and c["why"], name


_native = pytest.importorskip("qlayers._native")


@pytest.mark.skipif(not _native.available(),
                    reason="native library not built")
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "deepseek_v3",
                                  "mxfp8", "mxfp6", "mxfp4"])
def test_layers_agree_across_backends(name):
  """Forward and both gradients of a QuantDense on xla vs ffi (awkward dims)."""
  from flax import nnx
  x = jax.random.normal(jax.random.key(0), (3, 37, 200))
  results = {}
  for backend in ("xla", "ffi"):
    layer = qlayers.QuantDense(200, 72, recipe=name, backend=backend,
                               rngs=nnx.Rngs(0))
    def loss(m, x):
      y = m(x)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), grads = jax.jit(jax.value_and_grad(
        lambda m, x: loss(nnx.merge(*m), x), argnums=(0, 1), has_aux=True))(
            nnx.split(layer), x)
    results[backend] = (y, grads[1], grads[0][1]["kernel"][...])
  for a, b in zip(results["xla"], results["ffi"]):
    assert sqnr_db(a, b) > 100  # same quantized operands, FP32 accumulation
