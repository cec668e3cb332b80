"""What XLA:GPU makes of an MoE layer's quantized grouped GEMMs (deviceless).

One expert projection of an MoE layer, forward and backward: ``y =
ragged_dot(x, w, group_sizes)`` for ``x [tokens, d]`` sorted by expert and
``w [experts, d, f]``, differentiated with respect to ``x`` and ``w``
(Fprop, Dgrad and the per-expert Wgrad all live). BF16 runs
``jax.lax.ragged_dot``; each recipe runs ``qlayers.ops.quantized_ragged_dot``
(per-expert scales, one delayed history per expert). The program is compiled
for H200 (sm_90) and B200 (sm_100) without a GPU, as
``benchmarks/gpu_compile.py`` does (it also takes it: ``--programs moe``),
and this script reports, per target and recipe, each GEMM kernel XLA emits
(cuBLASLt FP8, cuBLAS, Triton, ...) with its operand dtypes and batch, how
many ``ragged-dot`` instructions are left to a generic emitter, loops,
and the roofline prediction of `gpu_compile.roofline` (a model, not a
measurement).

  PYTHONPATH=. .venv-gpu/bin/python benchmarks/moe_programs.py \\
      --targets h200,b200 --recipes bf16,fp8_current,mxfp8 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_compile as gc  # noqa: E402  pylint: disable=g-import-not-at-top

# Mixtral-8x7B's expert shapes (d 4096, SwiGLU 14336, 8 experts, top 2) at
# 4096 tokens: 8192 sorted rows.
DEFAULTS = {"rows": 8192, "d": 4096, "f": 14336, "experts": 8}


def moe_program(recipe: str, rows: int = DEFAULTS["rows"],
                d: int = DEFAULTS["d"], f: int = DEFAULTS["f"],
                experts: int = DEFAULTS["experts"]):
  """``(step, args, layers, cotangent param names)`` for one grouped
  projection, as `gpu_compile.layer_program` returns for a dense one."""
  jax = gc._jax()  # pylint: disable=protected-access
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top
  from qlayers import ragged  # pylint: disable=g-import-not-at-top

  r = qlayers.recipe(recipe)
  state = ragged.init_state(r, experts) if r.delayed else None

  def step(x, w, group_sizes, ct, state):
    def loss(x, w, state):
      if r.quantized:
        y, _ = qlayers.ops.quantized_ragged_dot(
            x, w, group_sizes, r, state, out_dtype=jnp.bfloat16)
      else:
        y = jax.lax.ragged_dot(x.astype(jnp.bfloat16),
                               w.astype(jnp.bfloat16), group_sizes)
      return jnp.sum(y.astype(jnp.float32) * ct)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, state)

  args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((experts, d, f), jnp.float32),
          jax.ShapeDtypeStruct((experts,), jnp.int32),
          jax.ShapeDtypeStruct((rows, f), jnp.float32),
          state)
  layers = [gc.LayerDims("experts", rows, d, f, weight_param="w")]
  return step, args, layers, ("ct",)


def kernels(text: str, target) -> dict:
  """The GEMM kernels (operand dtypes as the GEMM reads them: BF16/F32 for
  a quantized recipe means a dequantize first), leftover ragged-dots and
  loops of an optimized module, and its roofline prediction."""
  comps = gc.parse_module(text)
  gemms = collections.Counter()
  for _, g in gc.find_gemms(comps):
    d = g.dims
    batch = f"{d['batch']}x " if d.get("batch", 1) > 1 else ""
    gemms[f"{g.kernel} {g.a} x {g.b} -> {g.out} "
          f"[{batch}{d['m']}x{d['k']}x{d['n']}]"] += 1
  return {"gemms": dict(gemms),
          "ragged_dot": text.count(" ragged-dot("),
          "while": text.count(" while("),
          "roofline": gc.roofline(comps, target)}


def compile_moe(recipe: str, target_name: str, triton: bool, targets_dir,
                **shapes) -> dict:
  jax = gc._jax()  # pylint: disable=protected-access
  target = gc.TARGETS[target_name]
  device = gc.gpu_device(target, pathlib.Path(targets_dir))
  rec = {"recipe": recipe, "target": target_name, "triton": triton,
         **shapes}
  try:
    with gc.target_dispatch(target.arch):
      step, args, _, _ = moe_program(recipe, **shapes)
      lowered = jax.jit(step).lower(*gc._on_device(args, device))  # pylint: disable=protected-access
    opts = {} if triton else {"xla_gpu_enable_triton_gemm": False}
    text = lowered.compile(compiler_options=opts).as_text()
  except Exception as e:  # pylint: disable=broad-except
    rec.update(status="failed", error=gc.first_line(e))
    return rec
  rec.update(status="ok", **kernels(text, target))
  return rec


def markdown(records: list[dict]) -> str:
  lines = ["| target | Triton | recipe | GEMM kernels | ragged-dot left | "
           "loops | predicted us |",
           "|---|---|---|---|---|---|---|"]
  for r in records:
    if r["status"] != "ok":
      lines.append(f"| {r['target']} | {'on' if r['triton'] else 'off'} | "
                   f"{r['recipe']} | failed: {r['error']} | | | |")
      continue
    kinds = "; ".join(f"{n}x {k}" for k, n in sorted(r["gemms"].items()))
    lines.append(
        f"| {r['target']} | {'on' if r['triton'] else 'off'} | {r['recipe']}"
        f" | {kinds or 'none'} | {r['ragged_dot']} | {r['while']} | "
        f"{r['roofline']['time_us']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--targets", default="h200,b200")
  p.add_argument("--triton", default="on,off")
  p.add_argument("--recipes", default="bf16,fp8_current,fp8_delayed,"
                 "deepseek_v3,mxfp8")
  for k, v in DEFAULTS.items():
    p.add_argument(f"--{k}", type=int, default=v)
  p.add_argument("--targets-dir", default=gc._targets_dir())  # pylint: disable=protected-access
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)
  shapes = {k: getattr(a, k) for k in DEFAULTS}
  targets = gc._csv(a.targets, gc.TARGETS, "target")  # pylint: disable=protected-access
  tritons = gc._csv(a.triton, ("on", "off"), "--triton value")  # pylint: disable=protected-access
  records = []
  for target in targets:
    for triton in [t == "on" for t in tritons]:
      for recipe in a.recipes.split(","):
        rec = compile_moe(recipe, target, triton, a.targets_dir, **shapes)
        print(json.dumps({k: rec.get(k) for k in (
            "target", "triton", "recipe", "status", "gemms", "ragged_dot",
            "error")}), flush=True)
        records.append(rec)
  print(markdown(records))
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
