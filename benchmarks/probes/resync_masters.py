"""One qlayers.Optimizer step (AdamW, four 4096x4096 BF16 Params with FP32
masters) compiled for H200 without a device, with and without
resync_masters: kernels, bytes, predicted time (gpu_compile's roofline)."""
import pathlib, sys
sys.path.insert(0, "benchmarks")
import gpu_compile as gc
jax = gc._jax()
import jax.numpy as jnp, optax
from flax import nnx
import qlayers
from qlayers import optim

target = gc.TARGETS["h200"]
device = gc.gpu_device(target, pathlib.Path("/work/shared/gpu-targets"))
d = 4096

def program():
  model = nnx.Sequential(*[qlayers.QuantDense(
      d, d, recipe="fp8_current", use_bias=False, param_dtype=jnp.bfloat16,
      rngs=nnx.Rngs(i)) for i in range(4)])
  opt = qlayers.Optimizer(model, optax.adamw(1e-4))
  graphdef, state = nnx.split((model, opt))
  grads = nnx.state(model, nnx.Param)
  def step(state, grads):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, grads)
    return nnx.state((model, opt))
  return step, (state, grads)

real = optim.resync_masters
for name, fn in (("with resync", real), ("without", lambda s, p: s)):
  optim.resync_masters = fn
  step, args = program()
  lowered = jax.jit(step).lower(*gc._on_device(args, device))
  compiled, code, secs = gc.compile_with_code(lowered, {}, None, True)
  r = gc.roofline(gc.parse_module(compiled.as_text()), target, code)
  print(f"{name:13s} kernels {r['kernels']} MiB {r['bytes'] / 2**20:.1f} "
        f"time_us {r['time_us']:.1f}")
optim.resync_masters = real
