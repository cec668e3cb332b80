"""The Llama-3-8B block's train step data-parallel with FSDP over several
GPUs, compiled for them without a device: what each device runs.

`gpu_compile.py` compiles one device's program. This compiles the same
block (`gpu_compile.block_program`) for ``--devices`` GPUs of a target under
``jax.set_mesh``: the batch split over the mesh's one axis, every
matrix's rows too (FSDP), the rest replicated. It reports, per recipe, the
per-device program's kernels, its one-pass cast kernels (Pallas), the
bytes of each collective, and the roofline model's time of the device's
kernels (collectives counted as the bytes they move through memory; the
issue roof of `gpu_compile.roofline` included, ``issue us``), and
the collectives' time on the target's NVLink (``link us``: each ring's
traffic at the link's rate each way, no latency), which XLA's scheduler
must hide behind the kernels for the model time to hold. A prediction,
like every figure of `gpu_compile.py`.

  PYTHONPATH=. .venv-gpu/bin/python benchmarks/gpu_mesh.py --target h200 \\
      --devices 8 --recipes bf16,fp8_current,fp8_delayed --json F
  (--ffi-dir build/cuda/ffi for the FFI GEMMs, e.g. deepseek_v3 on h200)
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_compile as gc  # noqa: E402  pylint: disable=wrong-import-position

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")


def _collectives(hlo: str) -> dict[str, float]:
  """MiB each kind of collective returns, over the device's program."""
  out = collections.Counter()
  for line in hlo.splitlines():
    m = re.match(r"\s*%\S+ = (.+?) (" + "|".join(COLLECTIVES) +
                 r")(-start)?\(", line)
    if m:
      arrays = gc.parse_shape(m.group(1))
      # An async start returns (operands, results): count the results.
      arrays = arrays[len(arrays) // 2:] if m.group(3) else arrays
      out[m.group(2)] += sum(a.nbytes for a in arrays) / 2**20
  return dict(out)


def ring_traffic(kind: str, r: float, n: int) -> float:
  """Bytes each device sends for a ``kind`` collective returning ``r``
  bytes over ``n`` devices, by ring (NCCL's bandwidth term; no latency)."""
  if kind == "reduce-scatter":  # r is one shard of the reduced tensor
    return r * (n - 1)
  if kind == "all-reduce":
    return 2 * r * (n - 1) / n
  if kind == "collective-permute":
    return r
  return r * (n - 1) / n  # all-gather, all-to-all


def link_us(collectives_mib: dict[str, float], devices: int,
            target: gc.Target) -> float:
  """Microseconds the device's collectives take on its NVLink at the
  target's rate each way: a bound on what XLA must hide behind compute."""
  sent = sum(ring_traffic(kind, mib * 2**20, devices)
             for kind, mib in collectives_mib.items())
  return sent / (target.link_gbps * 1e9) * 1e6


def compile_block(recipe: str, target: gc.Target, devices: int,
                  targets_dir: pathlib.Path, batch: int, seq: int) -> dict:
  jax = gc._jax()  # pylint: disable=protected-access
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(
      platform="cuda", topology_name="",
      target_config=gc.target_config(target, targets_dir),
      topology=f"1x{devices}x1")
  mesh = Mesh(topo.devices, ("fsdp",))
  block = dict(gc.BLOCK_PRESETS["llama3-8b"], batch=batch, seq=seq)

  def place(a):
    rows = len(a.shape) == 2 and a.shape[0] % devices == 0
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P("fsdp") if rows else P()))

  batch_sharding = NamedSharding(mesh, P("fsdp"))
  with gc.target_dispatch(target.arch), jax.set_mesh(mesh):
    step, args, _, _ = gc.block_program(recipe, **block)
    state, x, target_y = args
    args = (jax.tree.map(place, state),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch_sharding)
              for a in (x, target_y)))
    # As gpu_compile.py's --triton off: cuBLAS/cuDNN GEMMs.
    lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
    # The kernels' partitioning rules lower their Pallas calls while XLA
    # compiles, outside this thread's mesh context; from jax 0.11 Pallas
    # Triton then takes the GPU generation from the default device (on a
    # GPU host, a GPU). Deviceless, that is this target's first device.
    previous = jax.config.jax_default_device
    jax.config.update("jax_default_device", topo.devices[0])
    try:
      compiled, code, _ = gc.compile_with_code(
          lowered, {"xla_gpu_enable_triton_gemm": False})
      hlo = compiled.as_text()
    finally:
      jax.config.update("jax_default_device", previous)
  comps = gc.parse_module(hlo)
  roof = gc.roofline(comps, target, code)
  collectives = _collectives(hlo)
  return {"recipe": recipe, "target": target.name, "devices": devices,
          "cudnn": gc.installed_cudnn(), "kernels": roof["kernels"],
          "pallas": len(re.findall(r"__gpu\$xla\.gpu\.triton", hlo)),
          "collectives_mib": collectives,
          "link_us": link_us(collectives, devices, target),
          "bytes_mib": roof["bytes"] / 2**20, "model_us": roof["time_us"],
          "issue_us": roof["issue_extra_us"],
          # What the PTX counts alone give (`gc.roofline`), and the kernels
          # the issue roof binds most.
          "ptx": roof.get("ptx"), "issue_bound": roof["issue_bound"][:10]}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="h200", choices=sorted(gc.TARGETS))
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--recipes", default="bf16,fp8_current,fp8_delayed")
  p.add_argument("--batch", type=int, default=8,
                 help="sequences per step (default: one per device of 8)")
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--targets-dir", type=pathlib.Path,
                 default=gc._targets_dir())  # pylint: disable=protected-access
  p.add_argument("--ffi-dir", default="",
                 help="folder with libqlayers_cuda.so (ffi/build_cuda.sh), "
                      "registered without a device: the FFI GEMMs "
                      "(deepseek_v3's blockwise, row-wise on sm_90)")
  p.add_argument("--json")
  a = p.parse_args()
  if a.ffi_dir:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
    _native.load(a.ffi_dir, gpu_without_device=True)
  records = [compile_block(r, gc.TARGETS[a.target], a.devices,
                           a.targets_dir, a.batch, a.seq)
             for r in a.recipes.split(",")]
  base = next((r for r in records if r["recipe"] == "bf16"), None)
  print(f"| recipe | kernels | Pallas | collectives MiB | link us | "
        f"bytes MiB | model us | issue us | vs bf16 | +launches vs bf16 |\n"
        f"|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
  for r in records:
    coll = ", ".join(f"{k} {v:,.0f}" for k, v in
                     sorted(r["collectives_mib"].items()))
    vs = f"{base['model_us'] / r['model_us']:.2f}x" if base else "-"
    vs_launched = "-"
    if base:  # gpu_compile.LAUNCH_US charged per kernel
      ratio = (gc.launched_us(base["model_us"], base["kernels"])
               / gc.launched_us(r["model_us"], r["kernels"]))
      vs_launched = f"{ratio:.2f}x"
    print(f"| {r['recipe']} | {r['kernels']} | {r['pallas']} | {coll} | "
          f"{r['link_us']:,.0f} | {r['bytes_mib']:,.0f} | "
          f"{r['model_us']:,.0f} | {r['issue_us']:,.0f} | {vs} | "
          f"{vs_launched} |")
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  main()
