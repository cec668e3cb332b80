"""The Dgrad copy of a frozen 4096 x 14336 weight made from its stored codes
(`qlayers.cast_transpose.mx_requantize`, `nvfp4_requantize` and
`nvfp4_amax`), alone, compiled for B200 without a device: predicted time,
and its part above the bytes (the SASS issue roof), per kernel group and
format.

  PYTHONPATH=. JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python \\
      benchmarks/probes/requantize_kernel.py [e4m3 e2m3 e2m1 nvfp4]
"""
import pathlib, sys
sys.path.insert(0, "benchmarks")
import gpu_compile as gc
jax = gc._jax()
import jax.numpy as jnp
from qlayers import cast_transpose as ct

N, K = 14336, 4096  # the stored copy: (N, K) along K
FORMATS = sys.argv[1:] or ["e4m3", "e2m3", "e2m1", "nvfp4"]


def program(fmt):
  """(function, argument shapes) of one format's Dgrad copy."""
  if fmt == "nvfp4":
    args = (jax.ShapeDtypeStruct((N, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((N // 16, K // 16), jnp.float32))
    return (lambda p, s: ct.nvfp4_requantize(p, s, ct.nvfp4_amax(p, s)),
            args)
  # E4M3 codes, FP6 values widened to E4M3, or packed E2M1 codes.
  payload = (jax.ShapeDtypeStruct((N, K // 2), jnp.uint8) if fmt == "e2m1"
             else jax.ShapeDtypeStruct((N, K), jnp.float8_e4m3fn))
  return (lambda p, s: ct.mx_requantize(p, s, fmt, "mx_rceil"),
          (payload, jax.ShapeDtypeStruct((N, K // 32), jnp.uint8)))


target = gc.TARGETS["b200"]
device = gc.gpu_device(target, pathlib.Path("/work/shared/gpu-targets"))
for fmt in FORMATS:
  fn, args = program(fmt)
  with gc.target_dispatch(target.arch):
    lowered = jax.jit(fn).lower(*gc._on_device(args, device))
  compiled, code, _ = gc.compile_with_code(lowered, {}, None, True)
  r = gc.roofline(gc.parse_module(compiled.as_text()), target, code)
  print(f"b200 {fmt:6s} model us {r['time_us']:6.1f}", flush=True)
  for name, (kernels, us, nbytes, issue_us) in r["groups"].items():
    print(f"  {name:28s} x{kernels} {us:6.1f} us (issue above bytes "
          f"{issue_us:5.1f}) {nbytes / 2**20:6.1f} MiB")
