"""GEMM throughput per backend and format, and where casting stops paying.

Usage (from the repository root)::

  python benchmarks/gemm.py                          # M=N=K 64 .. 2048
  python benchmarks/gemm.py --sizes 256,1024 --repeats 7 --json gemm.json
  python benchmarks/gemm.py --shapes 4096x1024x4096 --formats bf16,mxfp8

Every GEMM is ``out (M, N) = a (M, K) @ b (N, K).T`` (both operands
contraction-last, the layout the native kernels take), FP32 accumulation and
a BF16 output, through ``qlayers.dispatch.gemm`` with the backend forced:
``xla`` always, ``ffi`` where ``qlayers._native`` is built and supports the
operands. Two modes per format:

* ``gemm``: the GEMM alone, on operands quantized beforehand;
* ``q+gemm``: quantize both operands from BF16 (``qlayers.scaling.quantize``
  along K) and multiply, in one jitted function: what a layer pays per GEMM
  when nothing is cached. Its ratio to the BF16 dot says where low
  precision stops paying.

Formats: ``bf16`` (``dot_general`` of BF16 operands with
``preferred_element_type=float32``, cast to BF16: the unquantized path of
qlayers), ``bf16-out`` (BF16 result type, as ``nnx.Linear`` calls it),
``f32``, ``fp8`` (per-tensor E4M3), ``fp8-rowwise`` (one power-of-two scale
per row), ``fp8-blockwise`` (DeepSeek-V3: 1x128 tiles for ``a``, 128x128
blocks for ``b``), ``mxfp8``, ``mxfp6`` (E2M3), ``mxfp4`` (E2M1).

Timing: all variants of one shape are compiled first, then ``--repeats``
interleaved rounds (the order rotates each round); a sample runs the call
enough times to last ``--min-time`` seconds and records wall and process CPU
time (all threads) per call. Reported: medians; ratios vs ``bf16`` are the
median over rounds of the per-round ratio. On a shared machine the CPU-time
ratio is the steadier one (see ``harness.py``); a multi-threaded kernel
shows more CPU than wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import harness  # noqa: E402
import mdtable  # noqa: E402

TN = (((1,), (1,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class Format:
  """One row of the benchmark: a plain dot or a pair of quantization specs."""

  name: str
  description: str
  plain_dtype: Any = None  # plain dot on arrays of this dtype
  out_bf16: bool = False  # plain dot with a BF16 result type
  spec_a: Any = None
  spec_b: Any = None

  @property
  def quantized(self) -> bool:
    return self.spec_a is not None


def formats() -> dict[str, Format]:
  from qlayers.scaling import QuantSpec
  def pair(**kw):
    s = QuantSpec(**kw)
    return {"spec_a": s, "spec_b": s}
  fs = [
      Format("bf16", "BF16 x BF16, FP32 accumulate, cast to BF16",
             plain_dtype=jnp.bfloat16),
      Format("bf16-out", "BF16 x BF16 with BF16 result type (nnx.Linear)",
             plain_dtype=jnp.bfloat16, out_bf16=True),
      Format("f32", "FP32 x FP32", plain_dtype=jnp.float32),
      Format("fp8", "E4M3 per-tensor", **pair(format="e4m3")),
      Format("fp8-rowwise", "E4M3, one pow2 scale per row",
             **pair(format="e4m3", granularity="row", pow2=True)),
      Format("fp8-blockwise", "E4M3 1x128 tiles x 128x128 blocks",
             spec_a=QuantSpec(format="e4m3", granularity="tile"),
             spec_b=QuantSpec(format="e4m3", granularity="block")),
      Format("mxfp8", "E4M3, 32-blocks, E8M0",
             **pair(format="e4m3", granularity="mx")),
      Format("mxfp6", "E2M3, 32-blocks, E8M0",
             **pair(format="e2m3", granularity="mx")),
      Format("mxfp4", "E2M1, 32-blocks, E8M0",
             **pair(format="e2m1", granularity="mx")),
  ]
  return {f.name: f for f in fs}


@dataclasses.dataclass
class Variant:
  shape: tuple[int, int, int]
  fmt: str
  backend: str
  mode: str  # "gemm" or "q+gemm"
  fn: Callable | None = None
  args: tuple = ()
  n: int = 1
  compile_s: float = math.nan
  wall: list[float] = dataclasses.field(default_factory=list)
  cpu: list[float] = dataclasses.field(default_factory=list)
  error: str | None = None
  # Filled in after the rounds.
  wall_s: float = math.nan
  cpu_s: float = math.nan
  gflops: float = math.nan
  ratio_wall: float = math.nan
  ratio_cpu: float = math.nan

  @property
  def key(self) -> str:
    return f"{self.fmt}/{self.backend}/{self.mode}"


def _native_ok() -> tuple[bool, str]:
  try:
    from qlayers import _native
  except ImportError as e:
    return False, f"qlayers._native missing ({e})"
  if not _native.available():
    return False, _native.unavailable_reason()
  return True, str(_native.build_info()["details"]["cpu"].get("info", ""))


def _variants(shape, fmt: Format, backends: list[str], a, b) -> list[Variant]:
  from qlayers import dispatch, scaling
  out = []
  if not fmt.quantized:
    a_, b_ = a.astype(fmt.plain_dtype), b.astype(fmt.plain_dtype)
    if fmt.out_bf16:
      fn = lambda a, b: lax.dot_general(a, b, TN)
    else:
      fn = lambda a, b: lax.dot_general(
          a, b, TN, preferred_element_type=jnp.float32).astype(a.dtype)
    return [Variant(shape, fmt.name, "xla", "gemm", jax.jit(fn), (a_, b_))]
  qa = scaling.quantize(a, fmt.spec_a, 1)
  qb = scaling.quantize(b, fmt.spec_b, 1)
  for be in backends:
    v_gemm = Variant(shape, fmt.name, be, "gemm")
    v_q = Variant(shape, fmt.name, be, "q+gemm")
    if be == "ffi":
      from qlayers import _native
      ok, why = _native.supports(qa, qb)
      if not ok:
        v_gemm.error = v_q.error = f"not supported: {why}"
        out += [v_gemm, v_q]
        continue

    def gemm(qa, qb, be=be):
      return dispatch.gemm(qa, qb, axes=(1, 1), out_dtype=jnp.bfloat16,
                           backend=be)

    def q_gemm(a, b, be=be, fmt=fmt):
      return gemm(scaling.quantize(a, fmt.spec_a, 1),
                  scaling.quantize(b, fmt.spec_b, 1), be)

    v_gemm.fn, v_gemm.args = jax.jit(gemm), (qa, qb)
    v_q.fn, v_q.args = jax.jit(q_gemm), (a, b)
    out += [v_gemm, v_q]
  return out


def _sample(v: Variant) -> tuple[float, float]:
  c0, t0 = time.process_time(), time.perf_counter()
  out = None
  for _ in range(v.n):
    out = v.fn(*v.args)
  jax.block_until_ready(out)
  return ((time.perf_counter() - t0) / v.n, (time.process_time() - c0) / v.n)


def bench_shape(shape, fmts: list[Format], backends: list[str], *,
                repeats: int, min_time: float, seed: int = 0,
                log=print) -> list[Variant]:
  """Compiles and times every variant of one shape, interleaved."""
  m, n, k = shape
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  vs: list[Variant] = []
  for f in fmts:
    try:
      vs += _variants(shape, f, backends, a, b)
    except Exception as e:  # noqa: BLE001 - reported in the table
      vs.append(Variant(shape, f.name, "-", "gemm",
                        error=f"{type(e).__name__}: {e}".splitlines()[0]))
  live = []
  for v in vs:
    if v.error:
      continue
    try:
      t0 = time.perf_counter()
      jax.block_until_ready(v.fn(*v.args))
      v.compile_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      jax.block_until_ready(v.fn(*v.args))
      one = time.perf_counter() - t0
      v.n = max(1, min(10_000, math.ceil(min_time / max(one, 1e-7))))
      live.append(v)
    except Exception as e:  # noqa: BLE001
      v.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
  for r in range(repeats):
    k0 = r % max(1, len(live))
    for v in live[k0:] + live[:k0]:
      w, c = _sample(v)
      v.wall.append(w)
      v.cpu.append(c)
  base = next((v for v in live if v.fmt == "bf16"), None)
  flops = 2.0 * m * n * k
  for v in live:
    v.wall_s = float(np.median(v.wall))
    v.cpu_s = float(np.median(v.cpu))
    v.gflops = flops / v.wall_s / 1e9
    if base is not None:
      v.ratio_wall = float(np.median(np.array(v.wall) / np.array(base.wall)))
      v.ratio_cpu = float(np.median(np.array(v.cpu) / np.array(base.cpu)))
  log(f"{m}x{n}x{k}: " + ", ".join(
      f"{v.key} {v.cpu_s * 1e3:.2f}ms" for v in live))
  return vs


# ==========================================================================
# Reporting


def _ms(x: float) -> str:
  if not math.isfinite(x):
    return "—"
  return f"{x * 1e3:.3f}" if x < 0.01 else f"{x * 1e3:.2f}"


def _r(x: float) -> str:
  return "—" if not math.isfinite(x) else f"{x:.2f}x"


def render(results: list[Variant], fmts: dict[str, Format]) -> str:
  lines = []
  for mode, title in (("gemm", "GEMM on pre-quantized operands"),
                      ("q+gemm", "quantize both operands from BF16 + GEMM")):
    lines += [f"#### {title}", "", *mdtable.head(
        ["M x N x K", "format", "backend", "wall ms", "CPU ms",
         "GFLOP/s (wall)", "vs bf16 (CPU)", "vs bf16 (wall)"], "lllrrrrr")]
    for v in results:
      plain = not fmts[v.fmt].quantized if v.fmt in fmts else False
      if v.mode != mode and not (plain and mode == "q+gemm"):
        continue
      shape = "x".join(map(str, v.shape))
      if v.error:
        lines.append(mdtable.row(shape, v.fmt, v.backend, *["—"] * 4,
                                 v.error.replace("|", "/")[:120]))
        continue
      lines.append(mdtable.row(
          shape, v.fmt, v.backend, _ms(v.wall_s), _ms(v.cpu_s),
          f"{v.gflops:.1f}", _r(v.ratio_cpu), _r(v.ratio_wall)))
    lines.append("")
  lines += _crossover(results, fmts)
  return "\n".join(lines) + "\n"


def _crossover(results: list[Variant], fmts: dict[str, Format]) -> list[str]:
  """CPU-time ratio vs bf16 per size, and the smallest size that pays."""
  shapes = sorted({v.shape for v in results}, key=lambda s: s[0] * s[1] * s[2])
  keys = []
  for v in results:
    if fmts.get(v.fmt) is not None and fmts[v.fmt].quantized and (
        (v.fmt, v.backend) not in keys) and not v.error:
      keys.append((v.fmt, v.backend))
  lines = ["#### Crossover: CPU-time ratio vs the bf16 dot (< 1: low "
           "precision pays), GEMM only / quantize+GEMM", "", *mdtable.head(
               ["format", "backend", *("x".join(map(str, s)) for s in shapes),
                "pays from (GEMM only)", "pays from (q+GEMM)"],
               "ll" + "r" * len(shapes) + "ll")]
  for fmt, be in keys:
    cells = []
    ratios = {"gemm": [], "q+gemm": []}
    for s in shapes:
      got = {v.mode: v for v in results if v.shape == s and v.fmt == fmt
             and v.backend == be and not v.error}
      g, q = got.get("gemm"), got.get("q+gemm")
      rg = g.ratio_cpu if g else math.nan
      rq = q.ratio_cpu if q else math.nan
      ratios["gemm"].append(rg)
      ratios["q+gemm"].append(rq)
      cells.append(f"{_r(rg)} / {_r(rq)}")
    lines.append(mdtable.row(fmt, be, *cells, _pays(shapes, ratios["gemm"]),
                             _pays(shapes, ratios["q+gemm"])))
  return lines


def _pays(shapes, ratios) -> str:
  """Smallest shape from which every larger measured one is below 1x."""
  start = None
  for s, r in zip(shapes, ratios):
    if not math.isfinite(r):
      continue
    if r < 1.0:
      start = start or s
    else:
      start = None
  return "x".join(map(str, start)) if start else "never (in this range)"


def _shapes(args) -> list[tuple[int, int, int]]:
  """The ``(M, N, K)`` to run; ValueError names a malformed entry."""
  out = []
  if args.shapes:
    for s in filter(str.strip, args.shapes.split(",")):
      dims = s.strip().lower().split("x")
      if len(dims) != 3 or not all(d.strip().isdigit() for d in dims):
        raise ValueError(f"--shapes: {s!r} is not MxNxK (e.g. 512x256x1024)")
      out.append(tuple(int(d) for d in dims))
  else:
    for s in filter(str.strip, args.sizes.split(",")):
      if not s.strip().isdigit():
        raise ValueError(f"--sizes: {s!r} is not a positive integer")
      out.append((int(s),) * 3)
  if not out:
    raise ValueError("no shapes given")
  if any(d < 1 for shape in out for d in shape):
    raise ValueError(f"sizes must be positive: {out}")
  return out


def _positive(s: str) -> int:
  n = int(s)
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
  return n


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="64,128,256,512,1024,2048",
                 help="M=N=K values")
  p.add_argument("--shapes", default=None,
                 help="comma-separated MxNxK (overrides --sizes)")
  p.add_argument("--formats", default=None,
                 help="comma-separated subset of: " + ",".join(formats()))
  p.add_argument("--backends", default="xla,ffi")
  p.add_argument("--repeats", type=_positive, default=5)
  p.add_argument("--min-time", type=float, default=0.03,
                 help="seconds per sample (calls are repeated to fill it)")
  p.add_argument("--json", default=None, metavar="PATH")
  p.add_argument("--append-md", default=None, metavar="PATH")
  args = p.parse_args(argv)
  try:
    shapes = _shapes(args)
  except ValueError as e:
    p.error(str(e))
  log = lambda s: print(s, file=sys.stderr, flush=True)

  all_fmts = formats()
  names = args.formats.split(",") if args.formats else list(all_fmts)
  unknown = [n for n in names if n not in all_fmts]
  if unknown:
    log(f"unknown formats {unknown}; known: {list(all_fmts)}")
    return 2
  if "bf16" not in names:
    names.insert(0, "bf16")
  fmts = [all_fmts[n] for n in names]
  backends = args.backends.split(",")
  native_ok, native_info = _native_ok()
  if "ffi" in backends and not native_ok:
    log(f"ffi backend skipped: {native_info}")
    backends.remove("ffi")

  t_start = time.perf_counter()
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  machine = harness.machine_info()
  results: list[Variant] = []
  for shape in shapes:
    results += bench_shape(shape, fmts, backends, repeats=args.repeats,
                           min_time=args.min_time, log=log)
  wall = time.perf_counter() - t_start
  import jaxlib
  header = (
      f"- date: {started}; wall {wall:.0f} s\n"
      f"- machine: {machine['nproc']} cores, {machine['cpu']}, "
      f"{machine['jax_backend']}; load avg at start {machine['loadavg']}\n"
      f"- versions: Python {machine['python']}, jax {jax.__version__}, "
      f"jaxlib {jaxlib.__version__}; native: "
      f"{native_info if native_ok else 'unavailable'}\n"
      f"- timing: {args.repeats} interleaved rounds, each sample >= "
      f"{args.min_time * 1e3:.0f} ms of back-to-back calls; medians; ratios "
      "= median of per-round ratios to the bf16 dot; out = a @ b.T, BF16 "
      "output, FP32 accumulation\n")
  harness.publish(header + "\n" + render(results, all_fmts), args.append_md)
  if args.json:
    rows = []
    for v in results:
      d = {k: getattr(v, k) for k in (
          "fmt", "backend", "mode", "n", "compile_s", "wall_s", "cpu_s",
          "gflops", "ratio_wall", "ratio_cpu", "error", "wall", "cpu")}
      d["shape"] = list(v.shape)
      rows.append(d)
    out = {"started": started, "wall_s": wall, "machine": machine,
           "native": native_info, "args": vars(args), "results": rows}
    pathlib.Path(args.json).write_text(
        json.dumps(harness.json_safe(out), indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
