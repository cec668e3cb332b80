"""A QuantDense's forward alone (inference: no gradient, no residuals),
4096 tokens x 4096 -> 14336 in BF16, its kernel an FP32 Param or frozen
(`qlayers.freeze`, as served), compiled for H200 and B200 without a device:
kernels, bytes and predicted time (gpu_compile's roofline), per recipe,
against BF16. ``--lora R``: a LoRA step instead (rank-R adapter beside the
kernel, the adapter's gradients and the input's, as a layer inside a model
needs them), against a BF16 layer's. ``--devices D``: over D GPUs of
the target under ``jax.set_mesh`` (FSDP: the tokens split, each kernel
sharded along K, a frozen one's codes too), per device, with the
collectives' MiB and their ring time (`gpu_mesh.link_us`, not in the time).

  PYTHONPATH=. JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python \\
      benchmarks/probes/inference_layer.py [--lora 16] [--devices 8] \\
      [--targets h200,b200] [recipe ...]
"""
import argparse, contextlib, pathlib, sys
sys.path.insert(0, "benchmarks")
import gpu_compile as gc
import gpu_mesh
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
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--targets", default="h200,b200")
parser.add_argument("recipes", nargs="*", default=RECIPES)
args = parser.parse_args()
# "vs bf16" is against the BF16 Param program: compiled first, named or not.
args.recipes = ["bf16"] + [r for r in args.recipes if r != "bf16"]


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


def placed(fn_args, target, device):
  """The program's arguments on ``device``, or with ``--devices`` sharded
  over a mesh of the target's GPUs (FSDP: x's rows, every 2-D kernel array
  along K: a Param's dim 0, a frozen kernel's codes and scales, stored
  (N, K), dim 1); and the context to trace them under."""
  if args.devices == 1:
    return gc._on_device(fn_args, device), contextlib.nullcontext(), None
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  topo = topologies.get_topology_desc(
      platform="cuda", topology_name="",
      target_config=gc.target_config(target, pathlib.Path(
          "/work/shared/gpu-targets")), topology=f"1x{args.devices}x1")
  mesh = Mesh(topo.devices, ("fsdp",))

  def place(path, a):
    name, d = jax.tree_util.keystr(path), args.devices
    dim = (1 if "payload" in name or "scale" in name else 0
           ) if len(a.shape) == 2 and "lora" not in name else None
    spec = [None] * len(a.shape)
    if dim is not None and a.shape[dim] % d == 0:
      spec[dim] = "fsdp"
    return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                sharding=NamedSharding(mesh, P(*spec)))
  state, x = fn_args
  return ((jax.tree_util.tree_map_with_path(place, state),
           jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
               mesh, P("fsdp")))), jax.set_mesh(mesh), topo.devices[0])


for name in args.targets.split(","):
  target = gc.TARGETS[name]
  device = gc.gpu_device(target, pathlib.Path("/work/shared/gpu-targets"))
  base = None
  for recipe, frozen in [(r, f) for f in (False, True) for r in args.recipes]:
    fn, fn_args = program(recipe, frozen)
    fn_args, mesh, first = placed(fn_args, target, device)
    with gc.target_dispatch(target.arch), mesh:
      lowered = (jax.jit(fn).lower(*fn_args) if first is None else
                 jax.jit(fn).trace(*fn_args).lower(
                     lowering_platforms=("cuda",)))
      # As gpu_mesh.py: the kernels' partitioning rules lower their Pallas
      # calls while XLA compiles, for the default device's generation.
      previous = jax.config.jax_default_device
      if first is not None:
        jax.config.update("jax_default_device", first)
      try:
        compiled, code, _ = gc.compile_with_code(lowered, {}, None, True)
      finally:
        jax.config.update("jax_default_device", previous)
    hlo = compiled.as_text()
    r = gc.roofline(gc.parse_module(hlo), target, code)
    base = base or r["time_us"]  # the first: bf16 with a Param kernel
    kind = "frozen" if frozen else "param "
    links = ""
    if args.devices > 1:
      mib = gpu_mesh._collectives(hlo)
      links = (f" collectives MiB {sum(mib.values()):6.1f} link_us "
               f"{gpu_mesh.link_us(mib, args.devices, target):6.1f}")
    print(f"{name} {kind} {recipe:18s} kernels {r['kernels']:3d} "
          f"MiB {r['bytes'] / 2**20:7.1f} time_us {r['time_us']:7.1f} "
          f"vs bf16 {base / r['time_us']:.2f}x{links}", flush=True)
