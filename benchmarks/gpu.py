"""One prepared GPU check (written for an H200): FP8 GEMMs, MX, layer, step.

Usage (from the repository root; ``benchmarks/gpu.sh`` wraps it)::

  bash benchmarks/gpu.sh                    # on the GPU machine, ~8 min
  bash benchmarks/gpu.sh --cpu-smoke        # tiny sizes on CPU: every path
  bash benchmarks/gpu.sh --parts gemm,hlo   # a subset
  bash benchmarks/gpu.sh --out /tmp/gpu     # where the per-part JSON goes

Parts, each run in its own process under its own timeout (a hung or
crashing part is reported and the next one runs), inside ``--budget``:

``env``    nvidia-smi, JAX version and devices, ``qlayers.backends()``.
``gemm``   TFLOP/s of BF16 vs FP8 at 4096^3 and 8192^3: the XLA per-tensor
           pattern ``dot_general(fp8, fp8, preferred_element_type=f32)``
           times scalar scales (both operands contraction-last, and with
           ``b`` as (K, N) the way a layer's Fprop sees its kernel), the
           dequantize pattern ``dot(convert(fp8) * s, convert(fp8) * s)``,
           and quantize-from-BF16 + GEMM. Each compiled HLO
           (``jit(f).lower(...).compile().as_text()``) is searched for the
           cuBLASLt FP8 custom call ``__cublas$lt$matmul$f8``. Target: FP8
           >= 1.85x BF16 at 8192^3.
``mx``     MXFP8 through ``lax.scaled_dot`` (``qlayers.dispatch``), same
           sizes, with its custom calls.
``layer``  ``qlayers.ops.quantized_matmul`` forward + backward (3 GEMMs) per
           recipe against BF16, and how many FP8 GEMM custom calls it
           compiles to.
``step``   ``benchmarks/step.py`` (transformer, sized to fill the chip):
           BF16 vs qlayers fp8_delayed / fp8_current / mxfp8. Target >= 1.4x.

Timing: wall clock (``block_until_ready``) of the compiled executable,
median over repeats; each sample runs back-to-back calls for at least
``--min-time`` seconds. "speedup vs bf16" is BF16 time / variant time.
At the end one Markdown table is printed (and ``--out``/summary.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))

import mdtable  # noqa: E402

FP8_CALL = "__cublas$lt$matmul$f8"
PARTS = ("env", "gemm", "mx", "layer", "step")
# Seconds per part; the whole run also stops at --budget.
TIMEOUTS = {"env": 45, "gemm": 90, "mx": 60, "layer": 90, "step": 270}
SMOKE_TIMEOUTS = {"env": 60, "gemm": 240, "mx": 180, "layer": 300,
                  "step": 400}
TARGETS = {"gemm_fp8_8192": 1.85, "step": 1.4}
STEP_RECIPES = ("fp8_delayed", "fp8_current", "mxfp8")
# A transformer that keeps an H200 busy (about 0.7B parameters, 16k tokens
# per step, ~60 GB with the materialized attention of models.py).
STEP_ARGS = ["--model", "transformer", "--d-model", "4096", "--heads", "32",
             "--layers", "2", "--d-hidden", "16384", "--seq", "1024",
             "--batch", "16", "--vocab", "32768", "--steps", "5",
             "--rounds", "3", "--check-steps", "3"]
SMOKE_STEP_ARGS = ["--model", "transformer", "--d-model", "64", "--heads",
                   "2", "--layers", "1", "--d-hidden", "128", "--seq", "32",
                   "--batch", "2", "--vocab", "64", "--steps", "1",
                   "--rounds", "1", "--check-steps", "2"]


# ==========================================================================
# Helpers shared by the parts (run inside the part's own process)


def custom_calls(hlo_text: str) -> Counter:
  """custom_call targets in an optimized HLO module, with their counts."""
  return Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text))


def _timeit(fn, args, *, repeats: int, min_time: float) -> dict[str, Any]:
  """Compiles, warms up and times ``fn(*args)``; seconds per call."""
  import jax
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first_s = time.perf_counter() - t0
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
          "n": n, "repeats": repeats, "first_call_s": first_s}


def _compiled(fn, args):
  """``(executable, custom-call counts)`` of the jitted ``fn`` on ``args``."""
  exe = fn.lower(*args).compile()
  return exe, custom_calls(exe.as_text())


def _row(item: str, **kw) -> dict[str, Any]:
  return {"item": item, **kw}


def _calls(item: str, calls: Counter) -> dict[str, Any]:
  return {"calls": dict(calls)}


def _time_rows(cfg, variants, flops: float,
               fields=_calls) -> list[dict[str, Any]]:
  """Compiles and times ``(item, fn, args)`` variants, one row each.

  The first variant is the baseline of ``ratio``; ``fields(item, calls)``
  gives a row's entries after ``ms``. Every row is also printed as JSON.
  """
  rows, base = [], None
  for i, (item, fn, args) in enumerate(variants):
    try:
      exe, calls = _compiled(fn, args)
      t = _timeit(exe, args, repeats=cfg.repeats, min_time=cfg.min_time)
    except Exception as e:  # noqa: BLE001 - reported
      rows.append(_row(item, error=_err(e)))
      continue
    if i == 0:
      base = t["median_s"]
    row = _row(item, tflops=flops / t["median_s"] / 1e12,
               ratio=base / t["median_s"] if base else math.nan,
               ms=t["median_s"] * 1e3, **fields(item, calls))
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


# ==========================================================================
# Parts


def part_env(cfg) -> dict[str, Any]:
  info: dict[str, Any] = {}
  smi = shutil.which("nvidia-smi")
  if smi:
    r = subprocess.run([smi], capture_output=True, text=True, timeout=20)
    print(r.stdout or r.stderr, flush=True)
    q = subprocess.run(
        [smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True,
        timeout=20)
    info["gpu"] = q.stdout.strip()
  else:
    info["gpu"] = "nvidia-smi not found"
    print("nvidia-smi not found", flush=True)
  import jax
  import jaxlib
  info["jax"] = jax.__version__
  info["jaxlib"] = jaxlib.__version__
  info["backend"] = jax.default_backend()
  info["devices"] = [str(d) for d in jax.devices()]
  try:
    import qlayers
    info["qlayers"] = qlayers.backends()
    info["qlayers_api"] = {n: hasattr(qlayers, n) for n in (
        "quantize", "value_and_grad", "Optimizer")}
  except Exception as e:  # noqa: BLE001 - reported
    info["qlayers"] = f"import failed: {type(e).__name__}: {e}"
  print(json.dumps(info, indent=1, default=str), flush=True)
  rows = [_row("gpu", value=info["gpu"]),
          _row("jax", value=f"{info['jax']} ({info['backend']}: "
               f"{', '.join(info['devices'])})")]
  return {"rows": rows, "info": info}


def _fp8_operands(m, n, k, key=0):
  import jax
  import jax.numpy as jnp
  ka, kb = jax.random.split(jax.random.key(key))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  return a, b


def part_gemm(cfg) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  from jax import lax
  e4m3 = jnp.float8_e4m3fn
  tn = (((1,), (1,)), ((), ()))
  nn = (((1,), (0,)), ((), ()))

  def scale_of(x):
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / 448.0, 1.0)

  def cast(x, s):
    return jnp.clip(x.astype(jnp.float32) / s, -448.0, 448.0).astype(e4m3)

  def bf16_dot(a, b):
    return lax.dot_general(a, b, tn, preferred_element_type=jnp.float32
                           ).astype(jnp.bfloat16)

  def fp8_direct(a8, b8, sa, sb, dims=tn):
    out = lax.dot_general(a8, b8, dims, preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(jnp.bfloat16)

  def fp8_dequant(a8, b8, sa, sb):
    ad = a8.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    bd = b8.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return lax.dot_general(ad, bd, tn, preferred_element_type=jnp.float32
                           ).astype(jnp.bfloat16)

  def fp8_q_gemm(a, b):
    sa, sb = scale_of(a), scale_of(b)
    return fp8_direct(cast(a, sa), cast(b, sb), sa, sb)

  def fields(item, calls):
    f = {"fp8_call": FP8_CALL in calls, "calls": dict(calls)}
    if item == "8192^3 fp8 direct TN":
      f["target"] = TARGETS["gemm_fp8_8192"]
    return f

  rows = []
  for size in cfg.sizes:
    m = n = k = size
    a, b = _fp8_operands(m, n, k)
    sa, sb = jax.jit(scale_of)(a), jax.jit(scale_of)(b)
    a8, b8 = jax.jit(cast)(a, sa), jax.jit(cast)(b, sb)
    b8_kn = jnp.asarray(b8.T)
    variants = [
        ("bf16", jax.jit(bf16_dot), (a, b)),
        ("fp8 direct TN", jax.jit(fp8_direct), (a8, b8, sa, sb)),
        ("fp8 direct NN (b as KxN)",
         jax.jit(lambda a8, b8, sa, sb: fp8_direct(a8, b8, sa, sb, nn)),
         (a8, b8_kn, sa, sb)),
        ("fp8 dequant pattern", jax.jit(fp8_dequant), (a8, b8, sa, sb)),
        ("fp8 quantize+GEMM from bf16", jax.jit(fp8_q_gemm), (a, b)),
    ]
    rows += _time_rows(
        cfg, [(f"{size}^3 {name}", fn, args) for name, fn, args in variants],
        2.0 * m * n * k, fields)
  return {"rows": rows}


def part_mx(cfg) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  from jax import lax
  from qlayers import dispatch, scaling
  from qlayers.scaling import QuantSpec
  spec = QuantSpec(format="e4m3", granularity="mx")
  tn = (((1,), (1,)), ((), ()))
  rows = []
  for size in cfg.sizes:
    a, b = _fp8_operands(size, size, size)
    qa, qb = scaling.quantize(a, spec, 1), scaling.quantize(b, spec, 1)
    variants = [
        ("bf16", jax.jit(lambda a, b: lax.dot_general(
            a, b, tn, preferred_element_type=jnp.float32).astype(
                jnp.bfloat16)), (a, b)),
        ("mxfp8 lax.scaled_dot", jax.jit(
            lambda qa, qb: dispatch.scaled_dot_mx(qa, qb, jnp.bfloat16)),
         (qa, qb)),
        ("mxfp8 quantize+scaled_dot from bf16", jax.jit(
            lambda a, b: dispatch.scaled_dot_mx(
                scaling.quantize(a, spec, 1), scaling.quantize(b, spec, 1),
                jnp.bfloat16)), (a, b)),
    ]
    rows += _time_rows(
        cfg, [(f"{size}^3 {name}", fn, args) for name, fn, args in variants],
        2.0 * size**3)
  return {"rows": rows}


def part_layer(cfg) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import qlayers
  m = k = n = cfg.layer_size
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (k, n), jnp.float32)
  ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
  variants = []
  for name in ("bf16", "fp8_current", "fp8_delayed", "mxfp8"):
    state = qlayers.ops.init_state(name)

    def loss(x, w, state, ct, name=name):
      y, _ = qlayers.ops.quantized_matmul(x, w, name, state)
      return jnp.vdot(y.astype(jnp.float32), ct.astype(jnp.float32))

    variants.append((f"{m}x{k}x{n} fwd+bwd {name}",
                     jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
                     (x, w, state, ct)))
  rows = _time_rows(cfg, variants, 3 * 2.0 * m * n * k, lambda item, calls: {
      "fp8_calls": calls.get(FP8_CALL, 0), "calls": dict(calls)})
  return {"rows": rows}


def part_step(cfg) -> dict[str, Any]:
  out = pathlib.Path(cfg.out) / "step.json"
  cmd = [sys.executable, str(_HERE / "step.py"), "--no-peers", "--no-f32acc",
         "--qlayers-recipes", ",".join(STEP_RECIPES), "--json", str(out)]
  cmd += SMOKE_STEP_ARGS if cfg.cpu_smoke else STEP_ARGS
  print(" ".join(cmd), flush=True)
  # step.py exits 1 when a sanity check fails; its report is still written.
  rc = _run_group(cmd, cfg.part_timeout - 10, _child_env(cfg))
  if not out.exists():
    raise RuntimeError(f"step.py ended ({rc}) without a report")
  rep = json.loads(out.read_text())
  rows = []
  for res in rep["results"]:
    if res.get("error"):
      rows.append(_row(f"step {res['name']}", error=res["error"][:200]))
      continue
    speedup = 1.0 / res["ratio"] if res.get("ratio") else math.nan
    row = _row(f"step {res['name']}", ms=res["median_s"] * 1e3,
               ratio=speedup, loss_ok=res["loss_ok"])
    if res["name"] != "bf16":
      row["target"] = TARGETS["step"]
    rows.append(row)
  for name, why in rep.get("skipped", {}).items():
    rows.append(_row(f"step {name}", error=f"skipped: {why}"))
  return {"rows": rows, "info": {"config": rep.get("config"),
                                 "returncode": rc}}


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}".splitlines()[0][:300]


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
  """Runs one part in a child process under its timeout."""
  out = pathlib.Path(args.out) / f"{name}.json"
  out.unlink(missing_ok=True)
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--part",
         name, "--out", args.out, "--part-timeout", str(args.part_timeout),
         "--repeats", str(args.repeats), "--min-time", str(args.min_time)]
  if args.sizes:
    cmd += ["--sizes", args.sizes]
  if args.layer_size:
    cmd += ["--layer-size", str(args.layer_size)]
  if args.cpu_smoke:
    cmd.append("--cpu-smoke")
  t0 = time.perf_counter()
  rc = _run_group(cmd, args.part_timeout, _child_env(args))
  wall = time.perf_counter() - t0
  if out.exists():
    res = json.loads(out.read_text())
  else:
    res = {"rows": [], "error": f"exit {rc} after {wall:.0f} s (limit "
                                f"{args.part_timeout} s), no result"}
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
  """Inside a part's process: run it and write its JSON."""
  cfg = args
  sizes, layer = ([256, 512], 256) if cfg.cpu_smoke else ([4096, 8192], 8192)
  cfg.sizes = [int(v) for v in cfg.sizes.split(",")] if cfg.sizes else sizes
  cfg.layer_size = cfg.layer_size or layer
  fn = globals()[f"part_{args.part}"]
  try:
    res = fn(cfg)
  except Exception as e:  # noqa: BLE001 - reported by the driver
    import traceback
    traceback.print_exc()
    res = {"rows": [], "error": _err(e)}
  res["part"] = args.part
  path = pathlib.Path(args.out) / f"{args.part}.json"
  path.write_text(json.dumps(res, indent=1, default=str) + "\n")
  return 0


def _fmt(x, spec=".1f") -> str:
  if isinstance(x, float) and not math.isfinite(x):
    return "—"
  return format(x, spec) if isinstance(x, (int, float)) else str(x)


def render(results: dict[str, dict], smoke: bool = False) -> str:
  lines = mdtable.head(["part", "item", "TFLOP/s", "ms", "speedup vs bf16",
                        "FP8 cuBLASLt call", "target", "status", "notes"],
                       "llrrrllll")
  blank = [None] * 5
  for part, res in results.items():
    if res.get("error"):
      lines.append(mdtable.row(part, "—", *blank, "ERROR",
                               res["error"].replace("|", "/")))
    for r in res.get("rows", []):
      if "error" in r:
        lines.append(mdtable.row(part, r["item"], *blank, "ERROR",
                                 r["error"].replace("|", "/")[:200]))
        continue
      if "value" in r:
        lines.append(mdtable.row(part, r["item"], *blank, None,
                                 str(r["value"]).replace("|", "/")[:200]))
        continue
      fp8 = ""
      if "fp8_call" in r:
        fp8 = "found" if r["fp8_call"] else "not found"
      elif "fp8_calls" in r:
        fp8 = f"{r['fp8_calls']} call(s)"
      target = status = ""
      if "target" in r:
        target = f">= {r['target']}x"
        status = ("n/a (smoke)" if smoke else
                  "met" if r.get("ratio", 0) >= r["target"] else "MISSED")
      notes = []
      if r.get("loss_ok") is False:
        notes.append("loss sanity CHECK")
      if "calls" in r and part in ("mx", "layer"):
        notes.append(", ".join(f"{k} x{v}" for k, v in r["calls"].items())
                     or "no custom calls")
      lines.append(mdtable.row(
          part, r["item"], _fmt(r.get("tflops", math.nan)),
          _fmt(r.get("ms", math.nan), ".3f"),
          f"{_fmt(r.get('ratio', math.nan), '.2f')}x", fp8, target, status,
          "; ".join(notes).replace("|", "/")))
  return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny sizes on CPU; exercises every code path")
  p.add_argument("--parts", default=",".join(PARTS))
  p.add_argument("--out", default=None,
                 help="directory for per-part JSON (default: a temp dir)")
  p.add_argument("--budget", type=float, default=None,
                 help="seconds for all parts (default 480; smoke 1200)")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--min-time", type=float, default=None)
  p.add_argument("--sizes", default=None,
                 help="M=N=K of the gemm/mx parts (default 4096,8192)")
  p.add_argument("--layer-size", type=int, default=None,
                 help="M=K=N of the layer part (default 8192)")
  p.add_argument("--part", default=None, help=argparse.SUPPRESS)
  p.add_argument("--part-timeout", type=float, default=0,
                 help=argparse.SUPPRESS)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.repeats is None:
    args.repeats = 3 if args.cpu_smoke else 7
  if args.min_time is None:
    args.min_time = 0.01 if args.cpu_smoke else 0.05
  if args.out is None:
    import tempfile
    args.out = tempfile.mkdtemp(prefix="qlayers-gpu-")
  pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
  if args.part:
    return _child(args)

  budget = args.budget or (1200.0 if args.cpu_smoke else 480.0)
  limits = SMOKE_TIMEOUTS if args.cpu_smoke else TIMEOUTS
  parts = [p for p in args.parts.split(",") if p]
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    print(f"unknown parts {unknown}; known: {PARTS}", file=sys.stderr)
    return 2
  t_start = time.perf_counter()
  results: dict[str, dict] = {}
  for name in parts:
    left = budget - (time.perf_counter() - t_start)
    if left < 15:
      results[name] = {"rows": [], "error": "skipped: budget spent"}
      continue
    args.part_timeout = int(min(limits[name], left))
    print(f"=== {name} (limit {args.part_timeout} s)", flush=True)
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
  errors = [n for n, r in results.items() if r.get("error")]
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
