"""Saved-for-backward bytes of one block per recipe: ``memory.py block``.

Builds the tagged block of ``memory_common`` for every named recipe (with
``save_quantized_wgrad_input`` True and False), converts it with
``qlayers.quantize`` and compiles, never runs:

* the residuals: ``jax.jit(lambda p, r, x: jax.vjp(f, p, x)[1])``; the
  leaves of the vjp closure are what the forward pass saves for the backward
  pass, so the compiled output size (``memory_analysis()``) is the saved
  bytes;
* the step: ``jax.jit(jax.grad(loss, (0, 2)))``; its ``temp_size_in_bytes``.

Each residual, as ``jax.ad_checkpoint.print_saved_residuals`` lists it, is
classified by what saved it:

* *GEMM inputs*: a value named ``gemm_in:<projection>`` (a projection's input
  in its compute dtype, saved as is by a stock linear) or
  ``qlayers.ops.WGRAD_INPUT_NAME`` (what a quantized linear keeps of its
  input for the weight gradient: payload and scales, or the wide input);
  these are the eligible tensors of the seed's memory equation;
* *layernorm*, *attention*, *mlp (GELU)*: computed inside the region of that
  name, or the output of a projection that region consumes
  (``proj_out:q/k/v`` feed attention, ``proj_out:up`` the GELU);
* *block input x*, *params (saved as is)*: an argument of ``f(p, x)``
  (Params saved as they are alias the live master: no extra memory in a
  real step, but part of the compiled output);
* *scalars/constants*: literals, closed-over constants and anything of at
  most 4 KiB;
* *weight copies*: the rest, which is computed inside the projections from
  their Params; checked by listing the residuals again at twice the batch:
  a leaf whose shape and count do not change is independent of the tokens.
  Any that do change are reported as *other activations*.

Measured ratios are compared with the seed arithmetic: the eligible bytes
scale by ``bytes_per_element(recipe.wgrad.lhs) / 2`` (BF16 2, FP8 1, MXFP8
1.03125, MXFP6 0.78125, MXFP4 0.53125) and everything else stays as measured
for BF16. ``--attention fused`` runs the attention core under
``jax.checkpoint``, as a fused (flash) attention kernel would.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mdtable
import models
from memory_common import (MiB, OUT_TAG, SEED_BYTES, TAG, TARGETS, Saved,
                           add_block_size, block_config, block_input,
                           build_block, compile_memory, convert, failed_row,
                           finish_report, grouped, mib, saved_residuals,
                           shape_str, split, start_report, verdict)

__all__ = ["Measurement", "CATEGORIES", "classify", "measure", "render",
           "render_leaves", "findings", "add_parser", "run"]

CATEGORIES = ("GEMM inputs", "layernorm", "attention", "mlp (GELU)",
              "block input x", "other activations", "scalars/constants",
              "weight copies", "params (saved as is)")

REGIONS = {"layernorm": "layernorm", "attention": "attention",
           "mlp_gelu": "mlp (GELU)"}
# The category of a projection's output saved by the region consuming it.
CONSUMERS = {"q": "attention", "k": "attention", "v": "attention",
             "up": "mlp (GELU)"}
PROJECTIONS = ("q", "k", "v", "o", "up", "down")
SMALL = 4096  # bytes; anything this small counts as scalars/constants

_QUANT_DTYPES = ("float8", "uint8", "int8", "float4")


def _is_quant_dtype(dt) -> bool:
  return any(str(dt).startswith(p) for p in _QUANT_DTYPES)


# ==========================================================================
# Classification


@dataclasses.dataclass
class Residual:
  """One saved residual and what it was classified as."""

  saved: Saved
  category: str = ""
  layer: str = ""
  kind: str = ""  # GEMM inputs only: payload, scales, wide <dtype>


def _wgrad_name() -> str:
  from qlayers.ops import WGRAD_INPUT_NAME
  return WGRAD_INPUT_NAME


def _first_pass(s: Saved) -> tuple[str, str]:
  """``(category, layer)``; category "" for unnamed top-level residuals."""
  name = s.name
  if s.constant:
    return "scalars/constants", ""
  if s.argument is not None:
    return ("block input x" if s.argument == "x"
            else "params (saved as is)"), ""
  if name is not None and name.startswith(TAG):
    return "GEMM inputs", name[len(TAG):]
  if name == _wgrad_name():
    return "GEMM inputs", ""
  if s.nbytes <= SMALL:
    return "scalars/constants", ""
  if name is not None and name.startswith(OUT_TAG):
    layer = name[len(OUT_TAG):]
    return CONSUMERS.get(layer, "other activations"), layer
  if s.region is not None:
    return REGIONS.get(s.region, "other activations"), ""
  return "", ""


def _gemm_layers(rows: list[Residual]) -> None:
  """Names the projection of each ``WGRAD_INPUT_NAME`` residual.

  ``print_saved_residuals`` lists residuals in program order, and each
  quantized projection's saved input (payload, scales) is one run of
  consecutive named leaves, so the runs are the projections in call order.
  With any other number of runs than projections nothing is named.
  """
  wgrad = _wgrad_name()
  runs, prev = [], False
  for r in rows:
    named = r.saved.name == wgrad
    if named and not prev:
      runs.append([])
    if named:
      runs[-1].append(r)
    prev = named
  if len(runs) != len(PROJECTIONS):
    return
  for layer, run in zip(PROJECTIONS, runs):
    for r in run:
      r.layer = layer


def _gemm_kind(r: Residual, packed: bool, peers: list[Residual]) -> str:
  """payload / scales / wide copy, for a GEMM-input residual.

  FP8 payloads are float8; packed FP6/FP4 payloads and E8M0 block scales
  are both uint8, and of two uint8 arrays kept for one operand the scales
  are the one at most 1/8 as long in the last dim (the payload holds at
  least 4 bits per element, the scales 8 bits per 32 elements).
  """
  s = r.saved
  if s.dtype.startswith("float8"):
    return "payload"
  if s.nbytes <= SMALL or s.dtype == "float32" and s.name == _wgrad_name():
    return "scales"
  if s.dtype == "uint8":
    if not packed:
      return "scales"
    longest = max(p.saved.shape[-1] for p in peers
                  if p.saved.dtype == "uint8"
                  and p.saved.shape[:-1] == s.shape[:-1])
    return "scales" if 8 * s.shape[-1] <= longest else "payload"
  return f"wide {s.dtype}"


def classify(listed: list[Saved], listed_2x: list[Saved],
             packed: bool) -> list[Residual]:
  """Categories of the residuals ``listed``; ``listed_2x`` at twice the batch.

  ``packed``: the recipe saves its Wgrad input in a packed (uint8) format.
  """
  rows = [Residual(s) for s in listed]
  for r in rows:
    r.category, r.layer = _first_pass(r.saved)
  _gemm_layers(rows)
  # Unnamed top-level leaves: weight copies if they are there alike with
  # twice the tokens, other activations if not.
  key = lambda s: (s.dtype, s.shape)
  again = Counter(key(s) for s in listed_2x if _first_pass(s)[0] == "")
  for r in rows:
    if r.category == "":
      k = key(r.saved)
      r.category = "weight copies" if again[k] > 0 else "other activations"
      again[k] -= 1
  gemm = [r for r in rows if r.category == "GEMM inputs"]
  for r in gemm:
    r.kind = _gemm_kind(r, packed, gemm)
  return rows


# ==========================================================================
# Measuring one recipe


@dataclasses.dataclass
class Measurement:
  label: str
  recipe: str
  save_quantized: bool | None
  bytes_per_elem: float
  conversion: str
  residual_out_bytes: int = 0
  residual_sum_bytes: int = 0
  step_temp_bytes: int = 0
  step_out_bytes: int = 0
  by_category: dict[str, int] = dataclasses.field(default_factory=dict)
  gemm_in_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
  leaves: list[dict] = dataclasses.field(default_factory=list)
  compile_s: float = 0.0
  error: str | None = None

  @property
  def activation_bytes(self) -> int:
    """Saved bytes that are not Params or copies of them."""
    return sum(v for k, v in self.by_category.items()
               if k not in ("params (saved as is)", "weight copies"))


def measure(cfg: models.TransformerConfig, attention: str, recipe_name: str,
            save: bool | None, stream_dtype) -> Measurement:
  """Residual and step-temp bytes of one recipe on the block."""
  import qlayers
  from qlayers import scaling
  rec = qlayers.recipe(recipe_name)
  label = recipe_name
  if rec.quantized and save is not None:
    rec = rec.replace(save_quantized_wgrad_input=save)
    label += " (x saved " + ("quantized)" if save else "wide)")
  else:
    save = None
  quantized_x = bool(rec.quantized and rec.save_quantized_wgrad_input
                     and rec.wgrad.lhs)
  if quantized_x:
    bpe = scaling.bytes_per_element(rec.wgrad.lhs)
  else:
    bpe = float(np.dtype(rec.dtype).itemsize)
  cfg = dataclasses.replace(cfg, dtype=rec.dtype)
  m = Measurement(label, recipe_name, save, bpe, "")
  try:
    block = build_block(cfg, attention)
    m.conversion = convert(block, rec)
    gd, params, rest = split(block)
    x = block_input(cfg, stream_dtype)

    def f(p, r, x):
      return nnx.merge(gd, p, r)(x)

    res, step, m.compile_s = compile_memory(f, params, rest, x)
    m.residual_out_bytes = int(res.output_size_in_bytes)
    m.step_temp_bytes = int(step.temp_size_in_bytes)
    m.step_out_bytes = int(step.output_size_in_bytes)

    def f_px(p, x):
      return f(p, rest, x)

    x2 = jax.ShapeDtypeStruct((2 * x.shape[0], *x.shape[1:]), x.dtype)
    packed = quantized_x and rec.wgrad.lhs.fmt.packed
    rows = classify(saved_residuals(f_px, params, x),
                    saved_residuals(f_px, params, x2), packed)
    m.residual_sum_bytes = sum(r.saved.nbytes for r in rows)
    for r in rows:
      m.by_category[r.category] = (m.by_category.get(r.category, 0)
                                   + r.saved.nbytes)
      if r.category == "GEMM inputs":
        m.gemm_in_by_kind[r.kind] = (m.gemm_in_by_kind.get(r.kind, 0)
                                     + r.saved.nbytes)
    m.leaves = grouped(
        ({"category": r.category, "layers": r.layer, "dtype": r.saved.dtype,
          "shape": list(r.saved.shape), "source": r.saved.source},
         r.saved.nbytes) for r in rows)
  except Exception as e:  # noqa: BLE001 - reported in the table
    m.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  return m


# ==========================================================================
# Reporting


def _target_key(m: Measurement) -> str | None:
  if m.save_quantized is not True:
    return None
  if m.bytes_per_elem <= 0.6:
    return "mxfp4"
  if m.bytes_per_elem <= 1.05:
    return "fp8"
  return None


def render(results: list[Measurement], attention: str,
           cfg: models.TransformerConfig) -> str:
  base = next(r for r in results if r.recipe == "bf16" and not r.error)
  b_res, b_act = base.residual_out_bytes, base.activation_bytes
  b_gemm = base.by_category.get("GEMM inputs", 0)
  b_temp = base.step_temp_bytes
  lines = [
      f"#### Block, attention {attention}: d={cfg.d_model}, ff={cfg.d_ff}, "
      f"heads={cfg.n_heads}, seq={cfg.seq_len}, batch={cfg.batch}",
      "",
      *mdtable.head(
          ["recipe", "residuals (XLA output) MiB", "vs BF16",
           "saved activations MiB", "vs BF16", "seed prediction",
           "GEMM inputs MiB", "vs BF16", "seed B/elem / 2",
           "weights+params MiB", "step temp MiB", "temp vs BF16", "target"],
          "l" + "r" * 11 + "l"),
  ]
  for m in results:
    if m.error:
      lines.append(failed_row(m, 13))
      continue
    gemm = m.by_category.get("GEMM inputs", 0)
    weights = (m.by_category.get("weight copies", 0)
               + m.by_category.get("params (saved as is)", 0))
    pred_act = (b_act - b_gemm + b_gemm * m.bytes_per_elem / 2) / b_act
    act_ratio = m.activation_bytes / b_act
    key = _target_key(m)
    target = ""
    if key:
      t = TARGETS[key]
      target = (f"≤{t:.2f}: activations {verdict(act_ratio, t)}, GEMM "
                f"inputs {verdict(gemm / b_gemm, t)}")
    lines.append(mdtable.row(
        m.label, mib(m.residual_out_bytes),
        f"{m.residual_out_bytes / b_res:.3f}", mib(m.activation_bytes),
        f"{act_ratio:.3f}", f"{pred_act:.3f}", mib(gemm),
        f"{gemm / b_gemm:.3f}", f"{m.bytes_per_elem / 2:.3f}",
        mib(weights), mib(m.step_temp_bytes),
        f"{m.step_temp_bytes / b_temp:.3f}", target))
  share = b_gemm / b_act
  need = {k: (1 - t) / (1 - SEED_BYTES[k] / 2) for k, t in TARGETS.items()}
  lines += ["", f"GEMM inputs are {share:.1%} of the BF16 saved activations. "
            "Only they shrink, so a recipe saving b bytes per element reaches "
            "1 - share x (1 - b/2) at best; the targets need a share of at "
            "least " + " and ".join(f"{need[k]:.1%} (≤{TARGETS[k]:.2f}x, {k})"
                                    for k in TARGETS) + "."]
  lines += ["", "Where the saved bytes are (MiB, from the vjp residuals):", ""]
  ok = [m for m in results if not m.error]
  lines += mdtable.head(["category", *(m.label for m in ok)],
                        "l" + "r" * len(ok))
  cats = list(CATEGORIES) + sorted(
      {c for m in ok for c in m.by_category} - set(CATEGORIES))
  for c in cats:
    if not any(m.by_category.get(c) for m in ok):
      continue
    lines.append(mdtable.row(c, *(mib(m.by_category.get(c, 0)) for m in ok)))
  kinds = sorted({k for m in ok for k in m.gemm_in_by_kind})
  for k in kinds:
    lines.append(mdtable.row(f"GEMM inputs: {k}", *(
        mib(m.gemm_in_by_kind.get(k, 0)) for m in ok)))
  lines.append(mdtable.row("sum of residual leaves", *(
      mib(m.residual_sum_bytes) for m in ok)))
  return "\n".join(lines) + "\n"


def render_leaves(m: Measurement, min_share: float = 0.002) -> str:
  """The residual leaves of ``m`` grouped by what saved them, largest first."""
  lines = [f"Residual leaves of {m.label} (grouped by category, layer, dtype, "
           "shape and how jax.ad_checkpoint.print_saved_residuals describes "
           "them; largest first):", "",
           *mdtable.head(["category", "layers", "dtype", "shape", "count",
                          "MiB", "saved as"], "llllrrl")]
  total = sum(g["bytes"] for g in m.leaves) or 1
  top = sum(1 for g in m.leaves if g["bytes"] >= min_share * total)
  for g in m.leaves[:top]:
    lines.append(mdtable.row(
        g["category"], g["layers"], g["dtype"],
        shape_str(g["shape"]) or "scalar", g["count"],
        f"{g['bytes'] / MiB:.2f}", g["source"].replace("|", "/")))
  if len(m.leaves) > top:
    rest = sum(g["bytes"] for g in m.leaves[top:])
    lines.append(mdtable.row(f"{len(m.leaves) - top} smaller groups",
                             *[None] * 4, f"{rest / MiB:.2f}", None))
  return "\n".join(lines) + "\n"


def findings(results: list[Measurement]) -> list[str]:
  """What the quantized recipes save beyond the seed's arithmetic."""
  out = []
  base = next(r for r in results if r.recipe == "bf16" and not r.error)
  b_gemm = base.by_category.get("GEMM inputs", 0)
  for m in results:
    if m.error or m.save_quantized is None:
      continue
    wide = {k: v for k, v in m.gemm_in_by_kind.items() if k.startswith("wide")}
    gemm = m.by_category.get("GEMM inputs", 0)
    if m.save_quantized and wide:
      out.append(f"{m.label}: keeps a wide copy of a projection input "
                 f"besides the quantized one: "
                 + ", ".join(f"{k} {mib(v)} MiB" for k, v in wide.items()))
    expect = b_gemm * m.bytes_per_elem / 2
    if m.save_quantized and gemm > 1.02 * expect:
      out.append(f"{m.label}: GEMM-input bytes {mib(gemm)} MiB exceed the "
                 f"seed arithmetic {mib(expect)} MiB by "
                 f"{gemm / expect - 1:.1%}")
    if m.save_quantized and gemm < 0.98 * expect:  # the names not seen
      out.append(f"{m.label}: GEMM-input bytes {mib(gemm)} MiB fall short "
                 f"of the seed arithmetic {mib(expect)} MiB: residuals "
                 "named as Wgrad inputs were not found")
    wc = [g for g in m.leaves if g["category"] == "weight copies"
          and not _is_quant_dtype(g["dtype"]) and g["bytes"] > 4096]
    if wc:
      out.append(f"{m.label}: saves wide weight copies: " + ", ".join(
          f"{g['dtype']}[{shape_str(g['shape'])}] x{g['count']} "
          f"({g['source']})" for g in wc))
    other = m.by_category.get("other activations", 0)
    if other:
      out.append(f"{m.label}: {mib(other)} MiB of residuals depend on the "
                 "tokens but were made outside every named region and "
                 "projection name (other activations)")
  return out


# ==========================================================================
# Command


def run(args: argparse.Namespace) -> int:
  """The ``block`` command."""
  import qlayers
  cfg = block_config(args)
  names = (args.recipes.split(",") if args.recipes
           else qlayers.available_recipes())
  if "bf16" in names:
    names.remove("bf16")
  names.insert(0, "bf16")
  stream = jnp.dtype(args.stream_dtype)
  t_start = time.perf_counter()
  report = start_report(cfg, stream_dtype=str(stream))
  md = []
  for attention in args.attention.split(","):
    results = []
    for name in names:
      rec = qlayers.recipe(name)
      for save in ((True, False) if rec.quantized else (None,)):
        m = measure(cfg, attention, name, save, stream)
        print(f"[{attention}] {m.label}: residuals "
              f"{mib(m.residual_out_bytes)} MiB, step temp "
              f"{mib(m.step_temp_bytes)} MiB ({m.compile_s:.1f}s)"
              + (f" FAILED {m.error}" if m.error else ""),
              file=sys.stderr, flush=True)
        results.append(m)
    md.append(render(results, attention, cfg))
    for name in args.detail.split(",") if args.detail else ():
      for m in results:
        if m.recipe == name and m.save_quantized in (None, True):
          md.append(render_leaves(m))
    f = findings(results)
    md.append("Library checks (a wide copy of a projection input kept "
              "besides the quantized one, GEMM-input bytes off the seed "
              "arithmetic, wide weight copies in a quantized recipe): "
              + ("none found" if not f else "") + "\n"
              + "".join(f"- {s}\n" for s in f))
    report["runs"][attention] = [dataclasses.asdict(m) for m in results]
  finish_report(report, t_start, md, args.json, config=(
      f"block d={cfg.d_model} ff={cfg.d_ff} heads={cfg.n_heads} "
      f"seq={cfg.seq_len} batch={cfg.batch}, compute dtype per recipe, "
      f"FP32 params, residual stream {stream}"))
  return 0


def add_parser(sub) -> None:
  """The ``block`` subcommand's flags."""
  b = sub.add_parser("block", help="residual/temp bytes of a block per recipe")
  add_block_size(b)
  b.add_argument("--stream-dtype", default="float32",
                 help="dtype of the block input / residual stream (the "
                 "stock LM's is float32)")
  b.add_argument("--attention", default="materialized,fused",
                 help="comma-separated: materialized, fused")
  b.add_argument("--recipes", default=None,
                 help="comma-separated recipe names (default: all)")
  b.add_argument("--detail", default="bf16,fp8_current,mxfp4",
                 help="recipes whose residual leaves are listed")
  b.add_argument("--json", default=None, metavar="PATH")
