"""What the memory benchmarks share: the tagged block, compiling it, the
listing of its saved residuals, and the report header.

The block is the pre-norm block of ``models.py`` with its six projections
wrapped in `Tap` (``checkpoint_name`` on each projection's input, cast to the
compute dtype, and on its output) and, with ``regions=True``, its LayerNorms,
attention core and GELU each run as a jitted function named
``REGION + category``. `saved_residuals` lists what ``jax.vjp`` keeps with
``jax.ad_checkpoint.print_saved_residuals``, whose description of a residual
says which name or which jitted function produced it; that is all the
classification in ``memory_block.py`` and ``memory_remat.py`` reads.

Example::

  cfg = models.TransformerConfig(d_model=64, n_heads=2, n_layers=1, d_ff=128,
                                 seq_len=16, batch=2)
  block = build_block(cfg, "materialized")
  gd, params, rest = split(block)
  f = lambda p, x: nnx.merge(gd, p, rest)(x)
  for r in saved_residuals(f, params, block_input(cfg, jnp.float32)):
    print(r.dtype, r.shape, r.desc)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import pathlib
import platform
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import models

__all__ = ["MiB", "GB", "TAG", "OUT_TAG", "REGION", "SEED_BYTES", "TARGETS",
           "region", "Region",
           "Tap", "BlockAttention", "Block", "build_block", "convert",
           "split", "block_input", "compile_memory", "Saved",
           "saved_residuals", "grouped", "mib", "shape_str", "verdict",
           "failed_row", "start_report", "finish_report", "block_config",
           "add_block_size"]

MiB = 2**20
GB = 1e9
TAG = "gemm_in:"  # checkpoint_name of a projection's input
OUT_TAG = "proj_out:"  # checkpoint_name of a projection's output
REGION = "memory_region_"  # name prefix of the jitted region functions

# Bytes per saved element of each representation (seed, "memory" section).
SEED_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1.03125, "mxfp6": 0.78125,
              "mxfp4": 0.53125}

# Targets of issue 6 (saved-activation bytes relative to BF16).
TARGETS = {"fp8": 0.55, "mxfp4": 0.30}


# ==========================================================================
# The block


def region(name: str, fn: Callable, *args):
  """``fn(*args)`` run as a jitted function named ``REGION + name``.

  What ``jax.vjp`` saves from inside it is described by
  ``print_saved_residuals`` as "output of jitted function 'REGION name'".
  """
  def call(*a):
    return fn(*a)

  call.__name__ = call.__qualname__ = REGION + name
  return jax.jit(call)(*args)


class Region(nnx.Module):
  """Runs ``layer`` (its state passed in) as `region` ``name``."""

  def __init__(self, layer: nnx.Module, name: str):
    self.layer = layer
    self.name = name

  def __call__(self, x):
    gd, state = nnx.split(self.layer)
    return region(self.name, lambda s, x: nnx.merge(gd, s)(x), state, x)


class Tap(nnx.Module):
  """Wraps a projection: names its input (cast to ``dtype``) and output."""

  def __init__(self, layer: nnx.Module, name: str, dtype=None):
    self.layer = layer
    self.name = name
    self.dtype = dtype  # the GEMM's compute dtype; None: as it comes

  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(self.dtype)
    y = self.layer(checkpoint_name(x, TAG + self.name))
    return checkpoint_name(y, OUT_TAG + self.name)


class BlockAttention(models.Attention):
  """``models.Attention`` whose core is a region, optionally checkpointed.

  ``fused``: the core (scores, mask, softmax, PV) runs under
  ``jax.checkpoint``, as a fused (flash) attention kernel would: only its
  inputs Q, K, V are saved and the probabilities are recomputed.
  """

  def __init__(self, cfg, *, fused: bool, regions: bool, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.fused = fused
    self.regions = regions

  def core(self, q, k, v):
    core = super().core
    if self.fused:
      core = jax.checkpoint(core)
    if self.regions:
      return region("attention", core, q, k, v)
    return core(q, k, v)


class Block(models.Block):
  """``models.Block`` whose GELU is a region (``regions``)."""

  def __init__(self, cfg, *, regions: bool, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.regions = regions

  def activation(self, h):
    if self.regions:
      return region("mlp_gelu", super().activation, h)
    return super().activation(h)


def build_block(cfg: models.TransformerConfig, attention: str, seed: int = 0,
                *, regions: bool = True) -> nnx.Module:
  """A stock block (every projection an ``nnx.Linear``), tagged.

  Each projection is a `Tap` casting its input to ``cfg.dtype`` first (as
  the linear would); with ``regions`` the LayerNorms, the attention core and
  the GELU are regions named ``layernorm``, ``attention``, ``mlp_gelu``.
  """
  if attention not in ("materialized", "fused"):
    raise ValueError(f"attention must be 'materialized' or 'fused', got "
                     f"{attention!r}")
  rngs = nnx.Rngs(params=seed)
  block = Block(cfg, regions=regions, rngs=rngs)
  block.attn = BlockAttention(cfg, fused=attention == "fused",
                              regions=regions, rngs=rngs)
  for name in ("q", "k", "v", "o"):
    setattr(block.attn, name, Tap(getattr(block.attn, name), name, cfg.dtype))
  for name in ("up", "down"):
    setattr(block, name, Tap(getattr(block, name), name, cfg.dtype))
  if regions:
    block.ln1 = Region(block.ln1, "layernorm")
    block.ln2 = Region(block.ln2, "layernorm")
  return block


def convert(block: nnx.Module, recipe) -> str:
  """Quantizes the six projections with ``qlayers.quantize``."""
  import qlayers
  if not recipe.quantized:
    return "stock nnx.Linear"
  report = qlayers.quantize(block, recipe)
  if len(report.converted) != 6:
    raise RuntimeError(f"qlayers.quantize converted {len(report.converted)} "
                       f"of 6 projections: {report}")
  return "qlayers.quantize"


def split(block):
  """``(graphdef, params, rest)``, Params and the rest as pure arrays."""
  gd, params, rest = nnx.split(block, nnx.Param, ...)
  return gd, nnx.as_pure(params), nnx.as_pure(rest)


def block_input(cfg: models.TransformerConfig, dtype) -> jax.Array:
  return jax.random.normal(jax.random.key(1),
                           (cfg.batch, cfg.seq_len, cfg.d_model), dtype)


def compile_memory(f, params, rest, x):
  """Compiles (never runs) the residuals and the step of ``f(p, r, x)``.

  Returns both ``memory_analysis()`` results and the seconds it took.
  """
  def saved(p, r, x):
    return jax.vjp(lambda p, x: f(p, r, x), p, x)[1]

  # A cotangent passed in, not a constant: XLA would otherwise constant-
  # fold parts of the backward pass (slowly) and the step would not be
  # the one a training loop compiles.
  def loss(p, r, x, ct):
    return jnp.vdot(f(p, r, x).astype(jnp.float32), ct)

  t0 = time.perf_counter()
  res = jax.jit(saved).lower(params, rest, x).compile().memory_analysis()
  ct = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  step = jax.jit(jax.grad(loss, (0, 2))).lower(
      params, rest, x, ct).compile().memory_analysis()
  return res, step, time.perf_counter() - t0


# ==========================================================================
# Saved residuals, as jax.ad_checkpoint.print_saved_residuals describes them


def _short_name(dtype: np.dtype) -> str:
  # The short dtype names print_saved_residuals prints (f32, bf16, u8, ...).
  return (dtype.name.replace("float", "f").replace("uint", "u")
          .replace("int", "i").replace("complex", "c"))


_DTYPES = {_short_name(np.dtype(d)): np.dtype(d) for d in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "float32", "float64", ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn, ml_dtypes.int4, ml_dtypes.uint4)}
_LINE = re.compile(r"^([A-Za-z0-9_]+)\[([0-9,]*)\]\S*\s+(.*)$")


@dataclasses.dataclass(frozen=True)
class Saved:
  """One residual: its type and ``print_saved_residuals``' description."""

  dtype: str
  shape: tuple[int, ...]
  nbytes: int
  desc: str

  @property
  def name(self) -> str | None:
    """The ``checkpoint_name`` that saved it, if any."""
    m = re.match(r"^named '([^']*)'", self.desc)
    return m.group(1) if m else None

  @property
  def region(self) -> str | None:
    """The `region` it was computed in, if any."""
    m = re.match(rf"^output of jitted function '{REGION}([^']*)'", self.desc)
    return m.group(1) if m else None

  @property
  def argument(self) -> str | None:
    """The argument it is (``x``, ``p['attn']...``), if it is one."""
    m = re.match(r"^from the argument (\S+)", self.desc)
    return m.group(1) if m else None

  @property
  def constant(self) -> bool:
    return self.desc in ("from a literal", "from a constant")

  @property
  def source(self) -> str:
    """The description for listings, paths shortened: names and regions
    without their place (the one line that tags them), other producers
    with it."""
    if self.name is not None or self.region is not None:
      return self.desc.split(" from ")[0]
    return _shorten(self.desc)


def _shorten(desc: str) -> str:
  import qlayers
  roots = {str(pathlib.Path(m.__file__).resolve().parent.parent) + "/"
           for m in (models, qlayers)}
  desc = re.sub(r"\S*site-packages/", "", desc)
  for root in roots:
    desc = desc.replace(root, "")
  return desc


def _parse(line: str) -> Saved:
  m = _LINE.match(line.strip())
  if m is None or m.group(1) not in _DTYPES:
    raise ValueError(f"cannot read the residual {line.strip()!r} printed by "
                     "jax.ad_checkpoint.print_saved_residuals")
  dtype = _DTYPES[m.group(1)]
  shape = tuple(int(d) for d in m.group(2).split(",") if d)
  n = int(np.prod(shape, dtype=np.int64))
  return Saved(dtype.name, shape, n * dtype.itemsize, m.group(3))


def saved_residuals(f: Callable, *args) -> list[Saved]:
  """What ``jax.vjp(f, *args)`` saves, one `Saved` per residual.

  Read from ``jax.ad_checkpoint.print_saved_residuals``; arguments are
  named after ``f``'s parameters (``from the argument x``).
  """
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(f, *args)
  return [_parse(line) for line in buf.getvalue().splitlines()
          if line.strip()]


def grouped(leaves) -> list[dict]:
  """``(fields, nbytes)`` pairs merged by equal fields, largest first."""
  groups: dict[tuple, dict] = {}
  for fields, nbytes in leaves:
    key = tuple(tuple(v) if isinstance(v, list) else v
                for v in fields.values())
    g = groups.setdefault(key, {**fields, "count": 0, "bytes": 0})
    g["count"] += 1
    g["bytes"] += nbytes
  return sorted(groups.values(), key=lambda g: -g["bytes"])


# ==========================================================================
# Reporting


def mib(b: float) -> str:
  return f"{b / MiB:.1f}"


def shape_str(shape) -> str:
  return "x".join(map(str, shape))


def verdict(ratio: float, target: float) -> str:
  return "met" if ratio <= target else "MISSED"


def failed_row(m, columns: int) -> str:
  """The table row of a failed measurement: label, error, blank cells."""
  import mdtable
  return mdtable.row(m.label, f"failed: {m.error.replace('|', '/')}",
                     *[None] * (columns - 2))


def block_config(args) -> models.TransformerConfig:
  return models.TransformerConfig(d_model=args.d_model, n_heads=args.heads,
                                  n_layers=1, d_ff=args.d_ff,
                                  seq_len=args.seq, batch=args.batch)


def add_block_size(p) -> None:
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--d-ff", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--batch", type=int, default=4)


def start_report(cfg: models.TransformerConfig, **config) -> dict[str, Any]:
  """The JSON report of a block command: config, start, machine, ``runs``."""
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  report: dict[str, Any] = {"config": dataclasses.asdict(cfg) | {
      "dtype": "per recipe", "param_dtype": "float32", **config},
      "started": started, "machine": _machine(), "runs": {}}
  report["config"].pop("n_layers", None)
  return report


def finish_report(report: dict[str, Any], t_start: float, md: list[str],
                  json_path: str | None, config: str | None = None) -> None:
  """Prints the header of facts and the tables ``md``; writes the JSON."""
  report["wall_s"] = time.perf_counter() - t_start
  m = report["machine"]
  header = (f"- date: {report['started']}; wall {report['wall_s']:.0f} s "
            "(compile only, nothing executed)\n"
            f"- machine: {m['nproc']} cores, {m['cpu']}, {m['jax_backend']}; "
            f"load avg at start {m['loadavg']}\n"
            f"- versions: {m['versions']}\n")
  if config is not None:
    header += f"- config: {config}\n"
  print(header + "\n" + "\n".join(md))
  if json_path:
    pathlib.Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


def _machine() -> dict[str, Any]:
  import flax
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = []
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f
                 if l.lower().startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"nproc": os.cpu_count(), "cpu": cpu, "loadavg": load,
          "jax_backend": jax.default_backend(),
          "versions": f"python {platform.python_version()}, jax "
                      f"{jax.__version__}, flax {flax.__version__}"}
