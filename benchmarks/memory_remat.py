"""Saved bytes of a block under a names-only remat policy: ``memory.py remat``.

Runs the block of ``memory_common`` (no regions) under ``jax.checkpoint``
with a policy that saves only named values: for quantized recipes
``qlayers.remat_policy()`` (the quantized Wgrad inputs, named
``qlayers.ops.WGRAD_INPUT_NAME``); for BF16 the same policy over the BF16
projection inputs (the GEMM operands, after the cast from the FP32 LayerNorm
outputs), named with ``checkpoint_name`` either once per projection (q, k,
v, o, up, down: three copies of the attention input, as the quantized recipes
keep three quantized copies) or once per distinct tensor (the attention input
once, then o, up, down). Everything else is recomputed in the backward pass.
The residuals are read with ``jax.ad_checkpoint.print_saved_residuals``
(each leaf says whether it is an argument or which name saved it) and the
compiled residual function's ``memory_analysis()``. The block input is an
argument of the checkpointed block, so per-block remat always saves it; the
tables give the ratio without it (GEMM inputs only, as with remat over a
whole stack, where one input is saved for all blocks) and with it
(per-block remat).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mdtable
import models
from memory_common import (MiB, TAG, TARGETS, Saved, Tap, add_block_size,
                           block_config, block_input, build_block,
                           compile_memory, convert, failed_row, finish_report,
                           grouped, mib, saved_residuals, shape_str, split,
                           start_report, verdict)

__all__ = ["RematMeasurement", "measure_remat", "render_remat",
           "render_remat_leaves", "add_parser", "run"]

QKV = "qkv"  # tag of the attention input (shared by q, k, v)
PROJ = ("q", "k", "v", "o", "up", "down")


@dataclasses.dataclass
class RematMeasurement:
  label: str
  recipe: str
  policy: str
  bytes_per_elem: float
  residual_out_bytes: int = 0
  by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
  leaves: list[dict] = dataclasses.field(default_factory=list)
  step_temp_bytes: int = 0
  compile_s: float = 0.0
  error: str | None = None

  def get(self, kind: str) -> int:
    return self.by_kind.get(kind, 0)

  @property
  def gemm_inputs(self) -> int:
    return self.get("GEMM inputs")

  @property
  def saved_with_input(self) -> int:
    return self.gemm_inputs + self.get("block input") + self.get("other")


def remat_kind(s: Saved) -> str:
  """block input / params (saved as is) / GEMM inputs / scalars / other."""
  from qlayers.ops import WGRAD_INPUT_NAME
  if s.argument == "x":
    return "block input"
  if s.argument is not None:
    return "params (saved as is)"
  if s.name is not None and (s.name == WGRAD_INPUT_NAME
                             or s.name.startswith(TAG)):
    return "GEMM inputs"
  return "scalars/constants" if s.nbytes <= 4096 else "other"


def measure_remat(cfg: models.TransformerConfig, recipe_name: str,
                  policy_kind: str, stream_dtype) -> RematMeasurement:
  """Residual bytes of the block under ``jax.checkpoint(policy)``."""
  import qlayers
  from qlayers import scaling
  rec = qlayers.recipe(recipe_name)
  if rec.quantized:
    label = f"{recipe_name}: qlayers.remat_policy()"
    policy = qlayers.remat_policy()
    bpe = scaling.bytes_per_element(rec.wgrad.lhs)
  else:
    names = ([TAG + n for n in PROJ] if policy_kind == "per projection"
             else [TAG + n for n in (QKV, "o", "up", "down")])
    label = f"{recipe_name}: names of the BF16 GEMM inputs, {policy_kind}"
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    bpe = float(np.dtype(rec.dtype).itemsize)
  cfg = dataclasses.replace(cfg, dtype=rec.dtype)
  m = RematMeasurement(label, recipe_name, policy_kind, bpe)
  try:
    # Each projection names its input in the compute dtype (Tap casts the
    # FP32 LayerNorm output as the linear would); the attention input is
    # named once more, before it is shared by q, k and v.
    block = build_block(cfg, "materialized", regions=False)
    block.attn = Tap(block.attn, QKV, cfg.dtype)
    convert(block, rec)
    gd, params, rest = split(block)
    x = block_input(cfg, stream_dtype)

    def f(p, r, x):
      return jax.checkpoint(lambda p, x: nnx.merge(gd, p, r)(x),
                            policy=policy)(p, x)

    res, step, m.compile_s = compile_memory(f, params, rest, x)
    m.residual_out_bytes = int(res.output_size_in_bytes)
    m.step_temp_bytes = int(step.temp_size_in_bytes)

    def f_px(p, x):
      return f(p, rest, x)

    leaves = []
    for s in saved_residuals(f_px, params, x):
      kind = remat_kind(s)
      m.by_kind[kind] = m.by_kind.get(kind, 0) + s.nbytes
      src = s.desc.split(" from ")[0] if "named" in s.desc else s.desc
      leaves.append(({"kind": kind, "dtype": s.dtype,
                      "shape": list(s.shape), "source": src}, s.nbytes))
    m.leaves = grouped(leaves)
  except Exception as e:  # noqa: BLE001 - reported in the table
    m.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  return m


def _remat_target(m: RematMeasurement) -> float | None:
  if m.recipe == "bf16" or m.bytes_per_elem > 1.05:
    return None
  return TARGETS["mxfp4"] if m.bytes_per_elem <= 0.6 else TARGETS["fp8"]


def render_remat(results: list[RematMeasurement],
                 cfg: models.TransformerConfig, stream) -> str:
  bases = {m.policy: m for m in results if m.recipe == "bf16" and not m.error}
  lines = [
      f"#### Block under jax.checkpoint, names-only policy: d={cfg.d_model}, "
      f"ff={cfg.d_ff}, heads={cfg.n_heads}, seq={cfg.seq_len}, "
      f"batch={cfg.batch}, block input {np.dtype(stream).name}",
      "",
      *mdtable.head(
          ["policy", "GEMM inputs MiB", "block input MiB", "other MiB",
           "residuals (XLA output) MiB", "step temp MiB",
           "GEMM inputs vs BF16 (per proj. / shared)",
           "+ block input vs BF16 (per proj. / shared)", "target"],
          "l" + "r" * 7 + "l"),
  ]
  for m in results:
    if m.error:
      lines.append(failed_row(m, 9))
      continue
    r1, r2, v = [], [], []
    for pk in ("per projection", "shared"):
      b = bases.get(pk)
      if b is None:
        continue
      r1.append(m.gemm_inputs / b.gemm_inputs)
      r2.append(m.saved_with_input / b.saved_with_input)
    t = _remat_target(m)
    if t is not None and r1:
      v = [f"≤{t:.2f}: GEMM inputs {verdict(r1[0], t)}/"
           f"{verdict(r1[-1], t)}, + block input {verdict(r2[0], t)}/"
           f"{verdict(r2[-1], t)}"]
    lines.append(mdtable.row(
        m.label, mib(m.gemm_inputs), mib(m.get("block input")),
        mib(m.get("other") + m.get("scalars/constants")),
        mib(m.residual_out_bytes), mib(m.step_temp_bytes),
        " / ".join(f"{r:.3f}" for r in r1),
        " / ".join(f"{r:.3f}" for r in r2), "".join(v)))
  return "\n".join(lines) + "\n"


def render_remat_leaves(m: RematMeasurement) -> str:
  lines = [f"Saved under the policy, {m.label}:", "",
           *mdtable.head(["kind", "dtype", "shape", "count", "MiB",
                          "saved as"], "lllrrl")]
  for g in m.leaves:
    lines.append(mdtable.row(g["kind"], g["dtype"],
                             shape_str(g["shape"]) or "scalar", g["count"],
                             f"{g['bytes'] / MiB:.2f}", g["source"]))
  return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
  """The ``remat`` command."""
  import qlayers
  cfg = block_config(args)
  names = (args.recipes.split(",") if args.recipes else
           [n for n in qlayers.available_recipes()
            if qlayers.recipe(n).quantized])
  names = [n for n in names if n != "bf16"]
  t_start = time.perf_counter()
  report = start_report(cfg)
  md = []
  for stream_name in args.stream_dtype.split(","):
    stream = jnp.dtype(stream_name)
    results = [measure_remat(cfg, "bf16", pk, stream)
               for pk in ("per projection", "shared")]
    results += [measure_remat(cfg, n, "", stream) for n in names]
    for m in results:
      print(f"[remat {stream_name}] {m.label}: GEMM inputs "
            f"{mib(m.gemm_inputs)} MiB, block input "
            f"{mib(m.get('block input'))} MiB ({m.compile_s:.1f}s)"
            + (f" FAILED {m.error}" if m.error else ""),
            file=sys.stderr, flush=True)
    md.append(render_remat(results, cfg, stream))
    for m in results:
      if m.recipe in args.detail.split(",") and not m.error:
        md.append(render_remat_leaves(m))
    report["runs"][stream_name] = [dataclasses.asdict(m) for m in results]
  finish_report(report, t_start, md, args.json)
  return 0


def add_parser(sub) -> None:
  """The ``remat`` subcommand's flags."""
  r = sub.add_parser("remat", help="saved bytes of a block under "
                     "jax.checkpoint with a names-only policy")
  add_block_size(r)
  r.add_argument("--stream-dtype", default="float32",
                 help="comma-separated dtypes of the block input")
  r.add_argument("--recipes", default=None,
                 help="comma-separated quantized recipe names (default: all)")
  r.add_argument("--detail", default="bf16,fp8_current,mxfp4",
                 help="recipes whose saved leaves are listed")
  r.add_argument("--json", default=None, metavar="PATH")
