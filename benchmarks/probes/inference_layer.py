"""A QuantDense's forward alone (inference: no gradient, no residuals),
4096 tokens x 4096 -> 14336 in BF16, its kernel an FP32 Param or frozen
(`qlayers.freeze`, as served), compiled for H200 and B200 without a device:
kernels, bytes and predicted time (gpu_compile's roofline), per recipe,
against BF16. ``--lora R``: a LoRA step instead (rank-R adapter beside the
kernel, the adapter's gradients and the input's, as a layer inside a model
needs them), against a BF16 layer's.

  PYTHONPATH=. JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python \\
      benchmarks/probes/inference_layer.py [--lora 16] [recipe ...]
"""
import argparse, pathlib, sys
sys.path.insert(0, "benchmarks")
import gpu_compile as gc
jax = gc._jax()
import jax.numpy as jnp
from flax import nnx
import qlayers
from qlayers import _native

_native.load("build/cuda/ffi", gpu_without_device=True)

TOKENS, K, N = 4096, 4096, 14336
RECIPES = ["bf16", "fp8_current", "fp8_delayed", "fp8_rowwise",
           "deepseek_v3", "mxfp8", "mxfp6", "mxfp4", "nvfp4",
           "deepseek_v3_ue8m0"]
parser = argparse.ArgumentParser()
parser.add_argument("--lora", type=int, default=0)
parser.add_argument("recipes", nargs="*", default=RECIPES)
args = parser.parse_args()


def program(recipe, frozen):
  def make():
    layer = qlayers.QuantDense(K, N, recipe=recipe, dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(0))
    if frozen and layer.recipe.quantized:
      qlayers.freeze(layer)
    if args.lora:
      qlayers.add_lora(layer, args.lora, rngs=nnx.Rngs(1))
    return layer
  layer = nnx.eval_shape(make)
  if not args.lora:
    layer.eval()
  graphdef, state = nnx.split(layer)
  def forward(state, x):
    return nnx.merge(graphdef, state)(x)
  def lora_step(state, x):
    def loss(layer, x):
      return jnp.sum(layer(x).astype(jnp.float32) ** 2)
    wrt = nnx.DiffState(0, (nnx.LoRAParam, qlayers.QuantGradState))
    return nnx.grad(loss, argnums=(wrt, 1))(nnx.merge(graphdef, state), x)
  return (lora_step if args.lora else forward), (
      state, jax.ShapeDtypeStruct((TOKENS, K), jnp.bfloat16))


for name in ("h200", "b200"):
  target = gc.TARGETS[name]
  device = gc.gpu_device(target, pathlib.Path("/work/shared/gpu-targets"))
  base = None
  for recipe, frozen in [(r, f) for f in (False, True) for r in args.recipes]:
    fn, fn_args = program(recipe, frozen)
    with gc.target_dispatch(target.arch):
      lowered = jax.jit(fn).lower(*gc._on_device(fn_args, device))
    compiled, code, _ = gc.compile_with_code(lowered, {}, None, True)
    r = gc.roofline(gc.parse_module(compiled.as_text()), target, code)
    base = base or r["time_us"]
    kind = "frozen" if frozen else "param "
    print(f"{name} {kind} {recipe:18s} kernels {r['kernels']:3d} "
          f"MiB {r['bytes'] / 2**20:7.1f} time_us {r['time_us']:7.1f} "
          f"vs bf16 {base / r['time_us']:.2f}x", flush=True)
