"""The prepared GPU check: quantized GEMMs, the layer and a train step, timed.

Usage (from the repository root; ``benchmarks/gpu.sh`` sets up jax with its
CUDA plugin, checks ``jax.devices()`` and builds the native kernels first)::

  bash benchmarks/gpu.sh                    # on the GPU machine, ~8 min
  bash benchmarks/gpu.sh --cpu-smoke        # tiny sizes on CPU: every path
  bash benchmarks/gpu.sh --parts gemm       # a subset
  bash benchmarks/gpu.sh --out /tmp/gpu     # where the per-part JSON goes

Parts, each in its own process under its own time limit; the limits add up
to less than ``--budget`` (480 s), and every finished row is saved at once,
so a part that runs out of time still reports what it measured:

``env``    nvidia-smi, jax and its devices, ``qlayers.backends()`` (what
           the dispatch table picks here and why, and which native GPU
           kernels are loaded).
``gemm``   TFLOP/s of one GEMM on pre-quantized operands, as a layer's
           Fprop calls it (``qlayers.dispatch.gemm``, ``x (M, K) @ w (K,
           N)``), at 8192^3 and Llama-3-8B shapes (8192 tokens; q/o, gate/up,
           down): BF16, per-tensor FP8, row-wise FP8, blockwise FP8 (1x128 x
           128x128) and MXFP8, each compiled twice: XLA's default (the
           autotuner picks Triton or cuBLAS) and with Triton GEMMs off
           (cuBLAS/cuDNN only). Target: per-tensor FP8 >= 1.85x BF16 at
           8192^3.
``layer``  ``qlayers.ops.quantized_matmul`` forward + backward (3 GEMMs) per
           recipe at 8192x4096x4096, against BF16; then a frozen
           ``QuantDense``'s forward alone (eval mode, as served: the GEMM
           reads the stored codes) against a BF16 layer's.
``step``   train step of a small transformer (``benchmarks/models.py``) per
           recipe against the BF16 step (``qlayers.quantize`` +
           ``qlayers.Optimizer``), with the loss after the warm-up steps as a
           sanity check. Target: >= 1.4x.
``kernels`` the one-pass cast kernels (``qlayers.cast_transpose``: Pallas
           Triton) on this GPU against the CPU: each recipe's operand pairs
           of x, w and g, as the layer makes them (``operand_pair``), on
           data with NaN, Inf, overflow and underflow, compared bit for bit
           with the same call on the CPU, which makes them in XLA's passes
           (the values the CPU tests check the kernels against in Pallas'
           interpreter); and a delayed GEMM's end of step
           (``qlayers.history_roll``: one kernel rolling its three amax
           histories) the same way. A mismatch is an error row.
``block``  one train step of the Llama-3-8B block of ``gpu_compile.py``
           (d 4096, 32/8 heads, SwiGLU 14336, 4096 tokens, cuDNN fused
           attention) per recipe against BF16: the measurement that the
           deviceless prediction for that block is checked against.

Recipes that this checkout does not ship (nvfp4, deepseek_v3_ue8m0 until
they land) are left out of ``layer``, ``step`` and ``block``.

Every compiled GEMM is classified from the optimized HLO by what it runs
and on which operand types (``benchmarks/gpu_compile.py``: a Triton fusion
that reads FP8 payloads counts as FP8, one that converts them to BF16 first
as emulation), and each time is printed beside the roofline model of the
same HLO that the deviceless check uses (``gpu_compile.roofline``, at the
datasheet peaks of the attached GPU's class, with the issue roof of the
compile's own PTX): "model" is that prediction,
"meas/model" how far the GPU is from it, and "+launches" the same with
``gpu_compile.LAUNCH_US`` charged per kernel (which of the two the GPU
follows is what a run tells).

Timing: wall clock (``block_until_ready``) of the compiled executable,
median over repeats; each sample runs back-to-back calls for at least
``--min-time`` seconds. "speedup vs bf16" is BF16 time / variant time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))

import mdtable  # noqa: E402

PARTS = ("env", "kernels", "gemm", "layer", "step", "block")
BUDGET_S = 480.0
# Seconds per part; they add up to less than BUDGET_S (checked below).
TIMEOUTS = {"env": 25, "kernels": 45, "gemm": 95, "layer": 70, "step": 100,
            "block": 140}
SMOKE_BUDGET_S = 1200.0
SMOKE_TIMEOUTS = {"env": 60, "kernels": 120, "gemm": 280, "layer": 220,
                  "step": 270, "block": 240}
assert sum(TIMEOUTS.values()) < BUDGET_S
assert sum(SMOKE_TIMEOUTS.values()) < SMOKE_BUDGET_S
TARGETS = {"gemm_fp8_8192": 1.85, "step": 1.4}

# (label, M, K, N): 8192^3 and Llama-3-8B projections at 8192 tokens.
GEMM_SHAPES = (("8192^3", 8192, 8192, 8192),
               ("llama3-8b q/o", 8192, 4096, 4096),
               ("llama3-8b gate/up", 8192, 4096, 14336),
               ("llama3-8b down", 8192, 14336, 4096))
SMOKE_GEMM_SHAPES = (("256^3", 256, 256, 256), ("llama-like", 256, 128, 384))
# GEMM kind -> (x spec, w spec) as qlayers.scaling.QuantSpec keyword dicts.
GEMM_KINDS = {
    "bf16": None,
    "fp8 tensor": ({"format": "e4m3"}, {"format": "e4m3"}),
    "fp8 row-wise": ({"format": "e4m3", "granularity": "row", "pow2": True},
                     {"format": "e4m3", "granularity": "row", "pow2": True}),
    "fp8 blockwise": ({"format": "e4m3", "granularity": "tile"},
                      {"format": "e4m3", "granularity": "block"}),
    "mxfp8": ({"format": "e4m3", "granularity": "mx"},
              {"format": "e4m3", "granularity": "mx"}),
}
# Recipes in order of interest; those this checkout does not ship are left
# out (`_shipped`).
LAYER_RECIPES = ("bf16", "fp8_current", "fp8_delayed", "fp8_rowwise",
                 "deepseek_v3", "deepseek_v3_ue8m0", "mxfp8", "nvfp4",
                 "mxfp4", "mxfp6")
# Served: a frozen layer's forward (`qlayers.freeze`, eval mode).
SERVE_RECIPES = ("bf16", "fp8_current", "mxfp8", "nvfp4")
STEP_RECIPES = ("fp8_current", "fp8_delayed", "fp8_rowwise", "deepseek_v3",
                "mxfp8", "nvfp4", "mxfp4")
# The Llama-3-8B block (gpu_compile.BLOCK_PRESETS, cuDNN fused attention),
# one train step: what the deviceless prediction is made for.
BLOCK_RECIPES = ("bf16", "fp8_current", "mxfp8", "nvfp4", "mxfp4",
                 "deepseek_v3_ue8m0", "fp8_delayed", "deepseek_v3", "mxfp6")
# No GQA on CPU: with kv_heads 1 the fp8_current/fp8_delayed step of this
# block fails at run time on XLA:CPU ("Unsupported element type for
# DotThunk::Execute: BF16 x BF16 = F32"; jax 0.10.2).
SMOKE_BLOCK = dict(batch=1, seq=64, d=128, heads=2, kv_heads=2, ff=256,
                   attention="materialized")
# Recipes whose operand pairs `kernels` compares (each has a pair kernel on
# Hopper or Blackwell), and the shapes: x (tokens, K), w (K, N), g (tokens,
# N), multiples of 128 (DeepSeek-V3 tiles).
KERNEL_RECIPES = ("fp8_current", "fp8_delayed", "fp8_rowwise", "deepseek_v3",
                  "deepseek_v3_ue8m0", "mxfp8", "mxfp6", "mxfp4", "mxfp4_rht",
                  "nvfp4")
KERNEL_DIMS = (1024, 512, 768)
SMOKE_KERNEL_DIMS = (256, 128, 256)
# A small transformer that still gives the GEMMs real work (about 0.25B
# parameters, 8k tokens per step).
STEP_CONFIG = dict(d_model=2048, n_heads=16, n_layers=2, d_ff=8192,
                   seq_len=1024, batch=8, vocab=32768)
# 128 wide: the smallest that 128x128 weight blocks convert.
SMOKE_STEP_CONFIG = dict(d_model=128, n_heads=2, n_layers=1, d_ff=256,
                         seq_len=32, batch=2, vocab=128)


# ==========================================================================
# Helpers shared by the parts (run inside the part's own process)


def _gc():
  import gpu_compile  # pylint: disable=g-import-not-at-top
  return gpu_compile


def _shipped(names) -> list[str]:
  """``names`` that this qlayers ships as recipe files, in order."""
  import qlayers  # pylint: disable=g-import-not-at-top
  have = set(qlayers.available_recipes())
  return [n for n in names if n in have]


def _model_target():
  """The deviceless tool's target closest to the attached GPU."""
  from qlayers import dispatch  # pylint: disable=g-import-not-at-top
  arch = dispatch.gpu_arch("cuda")
  gc = _gc()
  return gc.TARGETS["b200" if arch and int(arch[3:]) >= 100 else "h200"]


def classify(hlo_text: str, layers=None, cotangents=(),
             quantized: bool = True, code=None) -> dict[str, Any]:
  """GEMM kernels of an optimized module by kernel and operand types, and
  the roofline model time of the whole module (with its kernels' ``code``,
  `gpu_compile.kernel_code`, the issue roof too)."""
  gc = _gc()
  comps = gc.parse_module(hlo_text)
  if layers:
    recs = [g for g in gc.describe(comps, layers, quantized, cotangents)
            if g["role"] not in ("other", "attention")]
  else:
    recs = [{"kernel": g.kernel, "a": g.a, "b": g.b, "out": g.out}
            for _, g in gc.find_gemms(comps)]
  kinds: dict[str, int] = {}
  for r in recs:
    key = f"{r['kernel']} [{r['a']} x {r['b']} -> {r['out']}]"
    kinds[key] = kinds.get(key, 0) + 1
  model = gc.roofline(comps, _model_target(), code)
  return {"gemms": kinds, "model_us": model["time_us"],
          "kernels": model["kernels"],
          "model_launched_us": gc.launched_us(model["time_us"],
                                              model["kernels"]),
          "fp8_gemms": sum(n for k, n in kinds.items() if _is_fp8(k))}


def _is_fp8(kind: str) -> bool:
  """A GEMM whose MMA reads 8-bit (or narrower) operands."""
  # "kernel [a x b -> out]"; an operand converted in the kernel reads
  # "f8e4m3fn->bf16" (no spaces), its MMA type last.
  operands = kind.rsplit("[", 1)[-1].rsplit(" -> ", 1)[0]
  if "emulated" in kind:
    return False
  views = [v.strip().split("->")[-1] for v in operands.split(" x ")]
  return all(v.startswith(("f8", "f6", "f4", "u8")) for v in views)


def _timeit(fn, args, *, repeats: int, min_time: float) -> dict[str, Any]:
  """Warms up and times ``fn(*args)``; seconds per call."""
  import jax
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t0, 1e-6)
  n = max(1, min(1000, math.ceil(min_time / one)))
  samples = []
  for _ in range(repeats):
    out = None
    t0 = time.perf_counter()
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / n)
  samples.sort()
  return {"median_s": samples[len(samples) // 2], "min_s": samples[0],
          "n": n, "repeats": repeats}


class Rows:
  """A part's rows, written to its JSON after every row."""

  def __init__(self, cfg, part: str):
    self.path = pathlib.Path(cfg.out) / f"{part}.json"
    self.rows: list[dict[str, Any]] = []
    self.info: dict[str, Any] = {}

  def add(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    print(json.dumps(row, default=str), flush=True)
    self.save(partial=True)

  def save(self, partial: bool = False, error: str | None = None) -> None:
    res = {"rows": self.rows, "info": self.info, "partial": partial}
    if error:
      res["error"] = error
    self.path.write_text(json.dumps(res, indent=1, default=str) + "\n")


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _measure(fn, args, cfg, *, flops: float, options=None, layers=None,
             cotangents=(), quantized: bool = True) -> dict[str, Any]:
  """Compiles ``fn`` (jitted) with XLA ``options``, classifies its GEMMs and
  times it."""
  # Its kernels' PTX and launch grids too, for the issue roof.
  exe, code, compile_s = _gc().compile_with_code(fn.lower(*args),
                                                  options or {})
  cls = classify(exe.as_text(), layers, cotangents, quantized, code)
  t = _timeit(exe, args, repeats=cfg.repeats, min_time=cfg.min_time)
  ms = t["median_s"] * 1e3
  return {"ms": ms, "tflops": flops / t["median_s"] / 1e12,
          "model_us": cls["model_us"], "meas_over_model":
          ms * 1e3 / cls["model_us"] if cls["model_us"] else math.nan,
          "kernels": cls["kernels"],
          "model_launched_us": cls["model_launched_us"],
          "gemms": cls["gemms"], "fp8_gemms": cls["fp8_gemms"],
          "compile_s": compile_s}


def _modes(cfg):
  """XLA GEMM settings to compile each variant with."""
  if cfg.cpu_smoke:
    return [("default", {})]
  return [("autotuned", {}),
          ("cuBLAS only", {"xla_gpu_enable_triton_gemm": False})]


# ==========================================================================
# Parts


def part_env(cfg) -> dict[str, Any]:
  info: dict[str, Any] = {}
  smi = shutil.which("nvidia-smi")
  if smi:
    q = subprocess.run(
        [smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    info["gpu"] = q.stdout.strip() or q.stderr.strip()
  else:
    info["gpu"] = "nvidia-smi not found"
  import flax
  import jax
  import jaxlib
  info["jax"] = (f"{jax.__version__} (jaxlib {jaxlib.__version__}, flax "
                 f"{flax.__version__})")
  info["devices"] = [f"{d} {getattr(d, 'compute_capability', '')}"
                     for d in jax.devices()]
  # Before qlayers' import, which needs flax >= 0.12.8 (pyproject.toml).
  print(f"jax {info['jax']}", file=sys.stderr, flush=True)
  import qlayers
  from qlayers import dispatch
  rep = qlayers.backends()
  info["arch"] = dispatch.gpu_arch("cuda")
  info["ffi_build"] = rep["ffi_build"]
  info["chosen"] = {n: f"{c['backend']}: {c['why']}"
                    for n, c in rep["chosen"].items()}
  print(json.dumps(info, indent=1, default=str), flush=True)
  rows = Rows(cfg, "env")
  rows.info = info
  rows.add({"item": "gpu", "value": info["gpu"]})
  rows.add({"item": "jax", "value": f"{info['jax']}: "
            f"{', '.join(info['devices'])}"})
  gpu_lib = rep["ffi_build"].get("details", {}).get("cuda", {}) \
      if isinstance(rep["ffi_build"], dict) else {}
  rows.add({"item": "native GPU kernels", "value": gpu_lib.get("info") or
            gpu_lib.get("reason") or "unknown"})
  return {"rows": rows.rows, "info": info}


def _quantized_operands(kind: str, m: int, k: int, n: int):
  """(x, w) for ``kind``: BF16 arrays, or QTensors quantized like a layer's
  Fprop operands (x along K, w along K)."""
  import jax
  import jax.numpy as jnp
  from qlayers import scaling
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
  specs = GEMM_KINDS[kind]
  if specs is None:
    return x, w
  sx, sw = (scaling.QuantSpec(**s) for s in specs)
  return jax.jit(lambda x, w: (scaling.quantize(x, sx, 1),
                               scaling.quantize(w, sw, 0)))(x, w)


def _kernel_data(shape, seed: int, nonfinite: bool = False):
  """Normal data over a wide range with values past every format's max and
  values that round to zero, and (``nonfinite``) a NaN and +-Inf, in the
  first rows (so the other blocks stay finite), as NumPy FP32."""
  import numpy as np
  rng = np.random.default_rng(seed)
  t = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, shape))
       ).astype(np.float32)
  t[3, shape[1] // 2], t[shape[0] // 2, 7], t[5, 11] = -1e30, 1e-12, 3e-4
  if nonfinite:
    t[0, 0], t[1, 3], t[2, 5] = np.nan, np.inf, -np.inf
  return t


def _kernel_cases(name: str, dims):
  """(role, t, last, first, arrays, static) of the three pairs a layer of
  recipe ``name`` makes (`qlayers.ops`): x for Fprop and Wgrad, w for Dgrad
  and Fprop, g for Dgrad and Wgrad, with its plan's operands, rounding keys,
  delayed state and dequantized copies (``arrays``: ``operand_pair``'s
  array arguments; ``static``: the delayed role's ``amax_compute_algo``
  and `Plan.dequantized`'s flags). g holds NaN and
  Inf unless it is scaled per tensor (a per-tensor copy is then all NaN)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import qlayers
  from qlayers import dispatch
  m, k, n = dims
  recipe = qlayers.recipe(name)
  p = dispatch.plan(recipe, (m, k), jnp.bfloat16, (k, n), jnp.bfloat16)
  per_tensor = p.dgrad.lhs.spec.granularity == "tensor"
  x = _kernel_data((m, k), 1).astype(jnp.bfloat16)
  w = _kernel_data((k, n), 2) * np.float32(0.02)
  g = _kernel_data((m, n), 3, nonfinite=not per_tensor).astype(jnp.bfloat16)
  keys = (jax.random.key(7), jax.random.key(8))
  state = qlayers.ops.init_state(recipe)
  rng = np.random.default_rng(4)
  cases = []
  for role, t, last, first in (
      ("x", x, p.fprop.lhs, p.wgrad.lhs if p.save_x == "wgrad" else None),
      ("w", w, None if p.share_w else p.dgrad.rhs,
       None if p.share_w else p.fprop.rhs),
      ("g", g, p.dgrad.lhs, None if p.share_g else p.wgrad.rhs)):
    arrays = {"keys": keys} if role != "w" else {}
    if state is not None:
      st = state[role]._replace(amax_history=jnp.asarray(
          rng.uniform(1.0, 300.0, state[role].amax_history.shape),
          jnp.float32))
      arrays["amax"], arrays["running"] = qlayers.operands.delayed_amax(
          jnp.asarray(t), st, recipe)
      arrays["state"] = st
    cases.append((role, t, last, first, arrays,
                  {"algo": recipe.amax_compute_algo,
                   "dequantized": p.dequantized[role]}))
  return cases


def _bit_mismatches(a, b) -> int:
  """Elements whose bits differ (every NaN counted as one value)."""
  import numpy as np
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return max(a.size, b.size)
  if a.dtype.kind == "f" or "float" in str(a.dtype):
    nan_a, nan_b = (np.isnan(v.astype(np.float32)) for v in (a, b))
    same = (a.view(np.uint8 if a.itemsize == 1 else f"u{a.itemsize}")
            == b.view(np.uint8 if b.itemsize == 1 else f"u{b.itemsize}"))
    return int(np.sum(~((nan_a & nan_b) | (same & ~nan_a & ~nan_b))))
  return int(np.sum(a != b))


def part_kernels(cfg) -> dict[str, Any]:
  """The operand pairs made on this GPU (the one-pass kernels where
  ``pairable``) against the same call on the CPU (XLA's passes)."""
  import jax
  from qlayers import table
  rows = Rows(cfg, "kernels")
  cpu = jax.devices("cpu")[0]
  gpu = jax.devices()[0]
  dims = SMOKE_KERNEL_DIMS if cfg.cpu_smoke else KERNEL_DIMS
  rows.info = {"dims": dims, "device": str(gpu)}
  # The smoke plans for Blackwell, so the kernel column names what a B200
  # would run (both sides then take XLA's branch, on the CPU).
  with (table.target_arch("sm_100") if cfg.cpu_smoke
        else contextlib.nullcontext()):
    _compare_pairs(rows, gpu, cpu, dims)
    _compare_requantized(rows, gpu, cpu, dims)
    _compare_rolls(rows, gpu, cpu)
  return {"rows": rows.rows, "info": rows.info}


def _compare_requantized(rows, gpu, cpu, dims) -> None:
  """A frozen MX or NVFP4 kernel's Dgrad copy made from its stored codes
  (`qlayers.operands.requantized_operand`: its kernel on this GPU) against
  the same call on the CPU (XLA's dequantize and quantize), the stored
  copy holding a NaN's block."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import qlayers
  from qlayers import dispatch
  from qlayers import operands
  from qlayers import scaling
  _, k, n = dims
  w = _kernel_data((k, n), 2, nonfinite=True) * np.float32(0.02)
  for name in _shipped(("mxfp8", "mxfp6", "mxfp4", "nvfp4")):
    item = f"{name} w stored, Dgrad copy from its codes"
    try:
      recipe = qlayers.recipe(name)
      p = dispatch.plan(recipe, (16, k), jnp.bfloat16, (k, n), jnp.bfloat16)
      with jax.default_device(cpu):
        stored = scaling.quantize(jnp.asarray(w).T, recipe.fprop.rhs, 1)

      def dgrad_copy(stored, op=p.dgrad.rhs):
        made = operands.requantized_operand(stored, op)
        if made is None:
          raise ValueError("not made from the stored codes on this target")
        return made
      kernels, bad, size = _against_cpu(jax.jit(dgrad_copy), (stored,),
                                        gpu, cpu)
    except Exception as e:  # noqa: BLE001 - reported
      rows.add({"item": item, "error": _err(e)})
      continue
    _bits_row(rows, item, bad, size, kernels)


def _compare_rolls(rows, gpu, cpu) -> None:
  """A GEMM's end of a delayed step (`qlayers.history_roll.end_step`: its
  kernel on this GPU) against the same call on the CPU (XLA's ops): three
  roles, the gradient's with an amax to merge, non-finite amaxes among
  them."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from qlayers import history_roll
  from qlayers.delayed import ScaleState
  rng = np.random.default_rng(5)
  states = [ScaleState(jnp.asarray(rng.uniform(0, 300, 1024), jnp.float32),
                       jnp.float32(a)) for a in (7.0, np.inf, 2.0)]
  updates = [None, None, jnp.float32(np.nan)]
  for item, ups in (("history roll", [None] * 3),
                    ("history roll, gradient amax merged", updates)):
    try:
      kernels, bad, size = _against_cpu(
          jax.jit(lambda states, ups=ups: history_roll.end_step(states, ups)),
          (states,), gpu, cpu)
    except Exception as e:  # noqa: BLE001 - reported
      rows.add({"item": item, "error": _err(e)})
      continue
    _bits_row(rows, item, bad, size, kernels)


def _against_cpu(fn, args, gpu, cpu) -> tuple[str, int, int]:
  """``fn`` (jitted) run on ``args`` on this GPU and on the CPU: (the
  qlayers kernels its GPU lowering launches, elements whose bits differ,
  elements)."""
  import re
  import jax
  kernels = sorted(set(re.findall(
      r'name = "(qlayers_\w+)"', fn.trace(*args).lower(
          lowering_platforms=("cuda",)).as_text())))
  got = jax.tree.leaves(fn(*jax.device_put(args, gpu)))
  with jax.default_device(cpu):
    want = jax.tree.leaves(fn(*jax.device_put(args, cpu)))
  return (", ".join(kernels) or "no kernel",
          sum(_bit_mismatches(a, b) for a, b in zip(got, want)),
          sum(a.size for a in want))


def _bits_row(rows, item: str, bad: int, size: int, what: str) -> None:
  """The row of one GPU-against-CPU comparison of ``size`` elements."""
  if bad:
    rows.add({"item": item, "error": f"{bad} of {size} elements differ "
              f"from the CPU's bits: {what}"})
  else:
    rows.add({"item": item, "value": f"bit-identical to the CPU ({size} "
              f"elements): {what}"})


def _compare_pairs(rows, gpu, cpu, dims) -> None:
  import jax
  from qlayers import operands
  for name in _shipped(KERNEL_RECIPES):
    try:
      cases = _kernel_cases(name, dims)
    except Exception as e:  # noqa: BLE001 - reported
      rows.add({"item": f"{name}", "error": _err(e)})
      continue
    for role, t, last, first, arrays, static in cases:
      item = f"{name} {role}"
      if last is None:
        rows.add({"item": item, "value": "one copy shared (no pair)"})
        continue
      try:
        def pair(t, arrays, last=last, first=first, static=static):
          kw = dict(arrays, dequantized=static["dequantized"])
          if "state" in kw:
            kw["delayed"] = (kw.pop("state"), static["algo"],
                             kw.pop("running"))
          return operands.operand_pair(t, last, first, **kw)
        paired = operands.pairable(jax.numpy.asarray(t), last, first)
        kernels, bad, size = _against_cpu(jax.jit(pair), (t, arrays), gpu,
                                          cpu)
      except Exception as e:  # noqa: BLE001 - reported
        rows.add({"item": item, "error": _err(e)})
        continue
      _bits_row(rows, item, bad, size,
                kernels + ("" if paired else " (not paired on this target)"))


def part_gemm(cfg) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  from qlayers import dispatch
  rows = Rows(cfg, "gemm")
  shapes = SMOKE_GEMM_SHAPES if cfg.cpu_smoke else GEMM_SHAPES
  gemm = jax.jit(lambda a, b: dispatch.gemm(a, b, axes=(1, 0),
                                            out_dtype=jnp.bfloat16))
  for label, m, k, n in shapes:
    base: dict[str, float] = {}
    for kind in GEMM_KINDS:
      try:
        a, b = _quantized_operands(kind, m, k, n)
      except Exception as e:  # noqa: BLE001 - reported
        rows.add({"item": f"{label} {kind}", "error": _err(e)})
        continue
      choice = dispatch.choose(a, b, "cuda" if not cfg.cpu_smoke else "cpu",
                               dispatch.gpu_arch("cuda"))
      for mode, options in _modes(cfg):
        item = f"{label} {kind} ({mode})"
        try:
          r = _measure(gemm, (a, b), cfg, flops=2.0 * m * n * k,
                       options=options)
        except Exception as e:  # noqa: BLE001 - reported
          rows.add({"item": item, "error": _err(e),
                    "form": f"{choice.backend}/{choice.form}"})
          continue
        if kind == "bf16":
          base[mode] = r["ms"]
        row = {"item": item, **r, "form": f"{choice.backend}/{choice.form}",
               "ratio": base[mode] / r["ms"] if mode in base else math.nan}
        if kind == "fp8 tensor" and label == "8192^3" and mode != "cuBLAS only":
          row["target"] = TARGETS["gemm_fp8_8192"]
        rows.add(row)
  return {"rows": rows.rows}


def part_layer(cfg) -> dict[str, Any]:
  """One quantized GEMM's forward and backward per recipe (`LAYER_RECIPES`),
  then a frozen layer's forward alone, as served (`SERVE_RECIPES`)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import qlayers
  gc = _gc()
  rows = Rows(cfg, "layer")
  m, k, n = (256, 256, 128) if cfg.cpu_smoke else (8192, 4096, 4096)
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (k, n), jnp.float32)
  ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
  layers = [gc.LayerDims("dense", m, k, n)]
  base = None
  for name in _shipped(LAYER_RECIPES):
    state = qlayers.ops.init_state(name)

    def loss(x, w, state, ct, name=name):
      y, _ = qlayers.ops.quantized_matmul(x, w, name, state)
      return jnp.vdot(y.astype(jnp.float32), ct.astype(jnp.float32))

    # The state too (as in training): under delayed scaling the gradient
    # amax leaves as its cotangent, and is dead code otherwise.
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    base = _timed_row(rows, f"{m}x{k}x{n} fwd+bwd {name}", fn,
                      (x, w, state, ct), cfg, base, name == "bf16",
                      flops=3 * 2.0 * m * n * k, layers=layers,
                      cotangents=("ct",),
                      quantized=qlayers.recipe(name).quantized)
  base = None
  for name in _shipped(SERVE_RECIPES):
    layer = qlayers.QuantDense(k, n, recipe=name, dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(0))
    layer.kernel[...] = w
    if layer.recipe.quantized:
      qlayers.freeze(layer)
    layer.eval()
    graph, params = nnx.split(layer)
    fn = jax.jit(lambda params, x, graph=graph: nnx.merge(graph, params)(x))
    base = _timed_row(rows, f"{m}x{k}x{n} fwd frozen {name}", fn,
                      (params, x), cfg, base, name == "bf16",
                      flops=2.0 * m * n * k, layers=layers,
                      quantized=layer.recipe.quantized)
  return {"rows": rows.rows}


def _timed_row(rows, item: str, fn, args, cfg, base, is_base: bool, **kw):
  """Times ``fn(*args)`` (`_measure`) into a row of ``rows`` with its
  speedup over ``base`` ms, or an error row; returns the base for the rows
  after it (this row's time where ``is_base``)."""
  try:
    r = _measure(fn, args, cfg, **kw)
  except Exception as e:  # noqa: BLE001 - reported
    rows.add({"item": item, "error": _err(e)})
    return base
  base = r["ms"] if is_base else base
  rows.add({"item": item, **r, "ratio": base / r["ms"] if base else math.nan})
  return base


def part_step(cfg) -> dict[str, Any]:
  import jax
  import models
  import step as step_bench
  import qlayers
  rows = Rows(cfg, "step")
  tcfg = models.TransformerConfig(**(SMOKE_STEP_CONFIG if cfg.cpu_smoke
                                     else STEP_CONFIG))
  rows.info = {"config": {k: str(v) for k, v in vars(tcfg).items()}}
  batch = models.make_batch(tcfg, seed=0)
  check_steps, steps = (2, 2) if cfg.cpu_smoke else (3, 10)
  base = base_loss = None
  variants = [("bf16", models.baseline_step)]
  variants += [(r, step_bench._qlayers_variant(qlayers, r).make)  # pylint: disable=protected-access
               for r in _shipped(STEP_RECIPES)]
  for name, make in variants:
    item = f"step {name}"
    try:
      t0 = time.perf_counter()
      fn, state = make(tcfg, seed=0)
      state, loss = fn(state, batch)
      jax.block_until_ready(loss)
      compile_s = time.perf_counter() - t0
      for _ in range(check_steps - 1):
        state, loss = fn(state, batch)
      loss = float(jax.block_until_ready(loss))
      times = []
      for _ in range(steps):
        t0 = time.perf_counter()
        state, out = fn(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported
      rows.add({"item": item, "error": _err(e)})
      continue
    ms = sorted(times)[len(times) // 2] * 1e3
    if name == "bf16":
      base, base_loss = ms, loss
    row = {"item": item, "ms": ms, "compile_s": compile_s, "loss": loss,
           "ratio": base / ms if base else math.nan,
           "loss_ok": bool(base_loss is not None and math.isfinite(loss) and
                           abs(loss - base_loss) <= 0.1 * abs(base_loss))}
    if name != "bf16":
      row["target"] = TARGETS["step"]
    rows.add(row)
    del fn, state
  return {"rows": rows.rows, "info": rows.info}


def part_block(cfg) -> dict[str, Any]:
  """One train step of the Llama-3-8B block (batch 1 x 4096 tokens, cuDNN
  fused attention) per recipe against BF16, each beside its deviceless
  model prediction."""
  import jax
  import jax.numpy as jnp
  import qlayers
  gc = _gc()
  rows = Rows(cfg, "block")
  shape = SMOKE_BLOCK if cfg.cpu_smoke else gc.BLOCK_PRESETS["llama3-8b"]
  rows.info = {"config": dict(shape)}
  kx, kt = jax.random.split(jax.random.key(0))
  dims = (shape["batch"], shape["seq"], shape["d"])
  x = jax.random.normal(kx, dims, jnp.float32).astype(jnp.bfloat16)
  target = jax.random.normal(kt, dims, jnp.float32)
  t = shape["batch"] * shape["seq"]
  d, ff = shape["d"], shape["ff"]
  kv = d // shape["heads"] * shape["kv_heads"]
  # q, k, v, o and the three MLP GEMMs, each forward + two backward GEMMs.
  flops = 3 * 2.0 * t * (2 * d * d + 2 * d * kv + 3 * d * ff)
  base = None
  for name in _shipped(BLOCK_RECIPES):
    item = f"llama3-8b block step {name}"
    try:
      step, (state, *_), layers, cts = gc.block_program(
          name, **shape, abstract=False)
      r = _measure(jax.jit(step), (state, x, target), cfg, flops=flops,
                   layers=layers, cotangents=cts,
                   quantized=qlayers.recipe(name).quantized)
    except Exception as e:  # noqa: BLE001 - reported
      rows.add({"item": item, "error": _err(e)})
      continue
    finally:
      state = None
    if name == "bf16":
      base = r["ms"]
    rows.add({"item": item, **r,
              "ratio": base / r["ms"] if base else math.nan})
  return {"rows": rows.rows, "info": rows.info}


# ==========================================================================
# Driver


def _child_env(cfg) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(_ROOT) + (
      os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  if cfg.cpu_smoke:
    env["JAX_PLATFORMS"] = "cpu"
  return env


def run_part(name: str, args) -> dict[str, Any]:
  """Runs one part in a child process under its time limit."""
  out = pathlib.Path(args.out) / f"{name}.json"
  out.unlink(missing_ok=True)
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--part",
         name, "--out", args.out, "--repeats", str(args.repeats),
         "--min-time", str(args.min_time)]
  if args.cpu_smoke:
    cmd.append("--cpu-smoke")
  t0 = time.perf_counter()
  rc = _run_group(cmd, args.part_timeout, _child_env(args))
  wall = time.perf_counter() - t0
  res = json.loads(out.read_text()) if out.exists() else {"rows": []}
  if rc == "timeout":
    res["error"] = (f"stopped at its {args.part_timeout:.0f} s limit after "
                    f"{len(res['rows'])} rows")
  elif rc != 0 and not res.get("error"):
    res["error"] = f"exit {rc} after {wall:.0f} s"
  res["wall_s"] = wall
  res["returncode"] = rc
  return res


def _run_group(cmd, timeout, env) -> int | str:
  """Runs ``cmd`` in its own process group; kills the whole group on timeout
  (a part's own children included). Returns the exit code or "timeout"."""
  proc = subprocess.Popen(cmd, env=env, start_new_session=True)
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
    return "timeout"


def _child(args) -> int:
  """Inside a part's process: run it; its rows are saved as they come."""
  fn = globals()[f"part_{args.part}"]
  path = pathlib.Path(args.out) / f"{args.part}.json"
  try:
    res = fn(args)
    res["partial"] = False
  except Exception as e:  # noqa: BLE001 - reported by the driver
    import traceback
    traceback.print_exc()
    res = json.loads(path.read_text()) if path.exists() else {"rows": []}
    res["error"] = _err(e)
  res["part"] = args.part
  path.write_text(json.dumps(res, indent=1, default=str) + "\n")
  return 0


def _fmt(x, spec=".1f") -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "—"
  return format(x, spec) if isinstance(x, (int, float)) else str(x)


def render(results: dict[str, dict], smoke: bool = False) -> str:
  lines = mdtable.head(["part", "item", "TFLOP/s", "ms", "model ms",
                        "meas/model", "+launches ms", "speedup vs bf16",
                        "target", "status", "GEMMs (kernel [a x b -> out])",
                        "notes"],
                       "llrrrrrrllll")
  blank = [None] * 7  # TFLOP/s to target: status, GEMMs and notes follow
  for part, res in results.items():
    if res.get("error"):
      lines.append(mdtable.row(part, "—", *blank, "ERROR", None,
                               res["error"].replace("|", "/")))
    for r in res.get("rows", []):
      if "error" in r:
        lines.append(mdtable.row(part, r["item"], *blank, "ERROR", None,
                                 r["error"].replace("|", "/")[:200]))
        continue
      if "value" in r:
        lines.append(mdtable.row(part, r["item"], *blank, None, None,
                                 str(r["value"]).replace("|", "/")[:200]))
        continue
      target = status = ""
      if "target" in r:
        target = f">= {r['target']}x"
        status = ("n/a (smoke)" if smoke else
                  "met" if r.get("ratio", 0) >= r["target"] else "MISSED")
      notes = []
      if r.get("form"):
        notes.append(r["form"])
      if r.get("loss_ok") is False:
        notes.append("loss sanity CHECK")
      if "compile_s" in r:
        notes.append(f"compile {r['compile_s']:.1f} s")
      gemms = "; ".join(f"{n}x {k}" for k, n in r.get("gemms", {}).items())
      model_ms = r["model_us"] / 1e3 if r.get("model_us") else None
      launched_ms = (r["model_launched_us"] / 1e3
                     if r.get("model_launched_us") else None)
      lines.append(mdtable.row(
          part, r["item"], _fmt(r.get("tflops")), _fmt(r.get("ms"), ".3f"),
          _fmt(model_ms, ".3f"), _fmt(r.get("meas_over_model"), ".2f"),
          _fmt(launched_ms, ".3f"),
          f"{_fmt(r.get('ratio'), '.2f')}x", target, status,
          gemms.replace("|", "/") or "—", "; ".join(notes)))
  return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny sizes on CPU; exercises every code path")
  p.add_argument("--parts", default=",".join(PARTS))
  p.add_argument("--out", default=None,
                 help="directory for per-part JSON (default: a temp dir)")
  p.add_argument("--budget", type=float, default=None,
                 help=f"seconds for all parts (default {BUDGET_S:.0f}; smoke "
                 f"{SMOKE_BUDGET_S:.0f}); part limits shrink to fit")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--min-time", type=float, default=None)
  p.add_argument("--part", default=None, help=argparse.SUPPRESS)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.repeats is None:
    args.repeats = 3 if args.cpu_smoke else 5
  if args.min_time is None:
    args.min_time = 0.01 if args.cpu_smoke else 0.03
  if args.out is None:
    import tempfile
    args.out = tempfile.mkdtemp(prefix="qlayers-gpu-")
  pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
  if args.part:
    return _child(args)

  budget = args.budget or (SMOKE_BUDGET_S if args.cpu_smoke else BUDGET_S)
  limits = SMOKE_TIMEOUTS if args.cpu_smoke else TIMEOUTS
  parts = [p for p in args.parts.split(",") if p]
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    print(f"unknown parts {unknown}; known: {PARTS}", file=sys.stderr)
    return 2
  # Scale the part limits down to the budget, never up.
  scale = min(1.0, (budget - 5) / sum(limits[p] for p in parts))
  t_start = time.perf_counter()
  results: dict[str, dict] = {}
  for name in parts:
    left = budget - (time.perf_counter() - t_start)
    if left < 15:
      results[name] = {"rows": [], "error": "skipped: budget spent"}
      continue
    args.part_timeout = max(10.0, min(limits[name] * scale, left - 2))
    print(f"=== {name} (limit {args.part_timeout:.0f} s)", flush=True)
    results[name] = run_part(name, args)
    print(f"=== {name} done in {results[name]['wall_s']:.0f} s", flush=True)
  wall = time.perf_counter() - t_start
  table = render(results, args.cpu_smoke)
  mode = "CPU smoke (tiny sizes; not a measurement)" if args.cpu_smoke \
      else "GPU"
  print(f"\n### qlayers GPU check ({mode}), {wall:.0f} s; JSON in "
        f"{args.out}\n")
  print(table)
  (pathlib.Path(args.out) / "summary.json").write_text(json.dumps(
      {"wall_s": wall, "cpu_smoke": args.cpu_smoke, "parts": results},
      indent=1, default=str) + "\n")
  (pathlib.Path(args.out) / "summary.md").write_text(table)
  errors = [n for n, r in results.items() if r.get("error")]
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
