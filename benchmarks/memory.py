"""Saved-for-backward bytes per recipe, and the memory equation.

Usage (from the repository root)::

  python benchmarks/memory.py block                  # d=1024 ff=4096 T=1024 B=4
  python benchmarks/memory.py block --attention fused --json mem.json
  python benchmarks/memory.py calc --params 70e9 --fsdp 8 --recipe mxfp4 \\
      --saved-elems 2e9 --wide-elems 1e9
  python benchmarks/memory.py calc --check-seed
  python benchmarks/memory.py remat --stream-dtype float32,bfloat16

``block`` builds one pre-norm transformer block of ``benchmarks/models.py``
(LayerNorm, Q/K/V/O projections, causal softmax attention, LayerNorm, MLP
``up``/GELU/``down``; all six projections ``nnx.Linear``), converts it with
``qlayers.quantize`` for every named recipe, with
``save_quantized_wgrad_input`` True and False, and compiles (never runs):

* the residuals: ``jax.jit(lambda p, r, x: jax.vjp(f, p, x)[1])``; the
  leaves of the vjp closure are exactly what the forward pass saves for the
  backward pass, so the compiled output size (``memory_analysis()``) is the
  saved bytes;
* the step: ``jax.jit(jax.grad(loss, (0, 2)))``; its ``temp_size_in_bytes``.

Each residual is classified from the jaxpr of the vjp: *GEMM inputs* (what
the forward keeps of the input of a projection for its weight gradient:
anything computed from a projection's input without passing through a GEMM;
the projection inputs are tagged with ``checkpoint_name``) are the eligible
tensors of the seed's memory equation; the rest is weight copies (computed
from Params only), Params saved as they are (an alias: no extra memory in a
real step, but part of the compiled output), LayerNorm internals, attention
(Q/K/V, scores, softmax), the MLP's GELU internals, the block input and
small scalars. Measured ratios are compared with the seed arithmetic: the
eligible bytes scale by ``bytes_per_element(recipe.wgrad.lhs) / 2`` (BF16 2,
FP8 1, MXFP8 1.03125, MXFP6 0.78125, MXFP4 0.53125) and everything else
stays as measured for BF16.

``--attention fused`` runs the attention core (scores, mask, softmax, PV)
under ``jax.checkpoint``, as a fused (flash) attention kernel would: it
saves only Q, K, V and recomputes the probabilities in the backward pass.

``remat`` runs the same block under ``jax.checkpoint`` with a policy that
saves only named values: for quantized recipes ``qlayers.remat_policy()``
(the quantized Wgrad inputs, named ``qlayers.ops.WGRAD_INPUT_NAME``); for
BF16 the same policy over the BF16 projection inputs (the GEMM operands, after
the cast from the FP32 LayerNorm outputs), tagged with ``checkpoint_name``
either once per projection (q, k, v, o, up, down: three
copies of the attention input, as the quantized recipes keep three quantized
copies) or once per distinct tensor (the attention input once, then o, up,
down). Everything else is recomputed in the backward pass. The residuals are
read with ``jax``'s ``saved_residuals`` (each leaf says whether it is an
argument or which name saved it) and the compiled residual function's
``memory_analysis()``. The block input is an argument of the checkpointed
block, so per-block remat always saves it; the tables give the ratio without
it (GEMM inputs only, as with remat over a whole stack, where one input is
saved for all blocks) and with it (per-block remat).

``calc`` evaluates the seed's memory equation (per device, GB = 1e9 bytes):
``M_persistent = P/N_F (4 master + m + v)``, ``M_gradient = P/N_F * 4``,
``M_saved = 2 A_h + A_e (b/8 + s/k)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))
sys.path.append(str(_HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402

import mdtable  # noqa: E402
import models  # noqa: E402

MiB = 2**20
GB = 1e9
TAG = "gemm_in:"

# Bytes per saved element of each representation (seed, "memory" section).
SEED_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1.03125, "mxfp6": 0.78125,
              "mxfp4": 0.53125}

# Targets of issue 6 (saved-activation bytes relative to BF16).
TARGETS = {"fp8": 0.55, "mxfp4": 0.30}


# ==========================================================================
# The memory equation


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of the seed's memory equation."""

  persistent: float
  gradient: float
  saved: float
  workspace: float

  @property
  def total(self) -> float:
    return self.persistent + self.gradient + self.saved + self.workspace


def memory_equation(params: float, fsdp: int = 1, *, wide_elems: float = 0.0,
                    eligible_elems: float = 0.0,
                    eligible_bytes: float = 2.0, moments: str = "fp32",
                    workspace: float = 0.0) -> MemoryEstimate:
  """The seed's expected per-device memory.

  Args:
    params: parameter count ``P``.
    fsdp: FSDP degree ``N_F`` (parameters, gradients and moments sharded).
    wide_elems: ``A_h``, saved elements that stay BF16 (2 bytes).
    eligible_elems: ``A_e``, saved elements in the low-precision form.
    eligible_bytes: ``b/8 + s/k`` bytes per eligible element.
    moments: ``fp32`` (4 + 4 bytes) or ``bf16`` (2 + 2, as DeepSeek-V3).
    workspace: bytes of compiler/backend workspace to add.

  Example:
    >>> e = memory_equation(70e9, 8)
    >>> round(e.persistent / 1e9), round(e.gradient / 1e9)
    (105, 35)
  """
  if moments not in ("fp32", "bf16"):
    raise ValueError(f"moments must be 'fp32' or 'bf16', got {moments!r}")
  if fsdp < 1:
    raise ValueError(f"fsdp must be >= 1, got {fsdp}")
  m = 4.0 if moments == "fp32" else 2.0
  shard = params / fsdp
  return MemoryEstimate(persistent=shard * (4.0 + 2 * m),
                        gradient=shard * 4.0,
                        saved=(2.0 * wide_elems
                               + eligible_elems * eligible_bytes),
                        workspace=workspace)


def saved_bytes_per_element(name: str) -> tuple[float, str]:
  """Bytes per eligible saved element for a format or a qlayers recipe name.

  A format name of the seed's table (``bf16``, ``fp8``, ``mxfp8``, ``mxfp6``,
  ``mxfp4``) gives its value; otherwise the recipe's Wgrad input spec decides
  (2 bytes when it keeps ``x`` wide).
  """
  if name in SEED_BYTES:
    return SEED_BYTES[name], "seed table"
  import qlayers
  from qlayers import scaling
  r = qlayers.recipe(name)
  if not (r.quantized and r.save_quantized_wgrad_input
          and r.wgrad.lhs is not None):
    return float(np.dtype(r.dtype).itemsize), f"recipe {r.name} (wide x)"
  return scaling.bytes_per_element(r.wgrad.lhs), f"recipe {r.name} wgrad.x"


def _calc(args: argparse.Namespace) -> int:
  if args.check_seed:
    return _check_seed()
  bpe, why = saved_bytes_per_element(args.recipe)
  eligible = args.saved_elems
  if args.tokens is not None:
    if args.d_model is None or args.d_ff is None:
      print("--tokens needs --d-model and --d-ff", file=sys.stderr)
      return 2
    # Inputs of Q/K/V (one shared tensor), O, up (d_model) and down (d_ff).
    eligible += args.layers * args.tokens * (3 * args.d_model + args.d_ff)
  est = memory_equation(args.params, args.fsdp, wide_elems=args.wide_elems,
                        eligible_elems=eligible, eligible_bytes=bpe,
                        moments=args.moments, workspace=args.workspace_gb * GB)
  bf16 = memory_equation(args.params, args.fsdp, wide_elems=args.wide_elems,
                         eligible_elems=eligible, eligible_bytes=2.0,
                         moments=args.moments, workspace=args.workspace_gb * GB)
  m = "4+4" if args.moments == "fp32" else "2+2"
  print(f"P = {args.params:.4g}, N_F = {args.fsdp}, moments {args.moments}, "
        f"A_h = {args.wide_elems:.4g} (BF16), A_e = {eligible:.4g} at "
        f"{bpe:g} B/elem ({why})\n")
  print("\n".join(mdtable.head(
      ["term", "formula", "GB per device", "with BF16 saved"], "llrr")))
  rows = [
      ("persistent", f"P/N_F x (4 master + {m} moments)", est.persistent,
       bf16.persistent),
      ("gradient", "P/N_F x 4", est.gradient, bf16.gradient),
      ("saved", f"2 A_h + A_e x {bpe:g}", est.saved, bf16.saved),
      ("workspace", "given", est.workspace, bf16.workspace),
      ("total", "", est.total, bf16.total),
  ]
  for name, formula, v, vb in rows:
    print(mdtable.row(name, formula, f"{v / GB:.2f}", f"{vb / GB:.2f}"))
  if bf16.saved:
    print(f"\nsaved / BF16 saved = {est.saved / bf16.saved:.3f}")
  return 0


def _check_seed() -> int:
  """Reproduces the seed's figures; exit status 1 if one is off."""
  from qlayers import scaling
  from qlayers.scaling import QuantSpec
  ok = True
  e = memory_equation(70e9, 8)
  print("70B parameters, FSDP-8, FP32 master + Adam moments:")
  for name, v, want in (("persistent", e.persistent, 105e9),
                        ("gradient", e.gradient, 35e9)):
    good = abs(v - want) < 0.5e9
    ok &= good
    print(f"  {name}: {v / GB:.1f} GB (seed: about {want / GB:.0f} GB) "
          f"{'ok' if good else 'MISMATCH'}")
  e = memory_equation(70e9, 8, moments="bf16")
  print(f"  persistent with BF16 moments: {e.persistent / GB:.1f} GB")
  print("\nBytes per eligible element (seed table vs "
        "qlayers.scaling.bytes_per_element):")
  specs = {"bf16": None, "fp8": QuantSpec(format="e4m3"),
           "mxfp8": QuantSpec(format="e4m3", granularity="mx"),
           "mxfp6": QuantSpec(format="e2m3", granularity="mx"),
           "mxfp4": QuantSpec(format="e2m1", granularity="mx")}
  for name, spec in specs.items():
    lib = scaling.bytes_per_element(spec)
    good = lib == SEED_BYTES[name]
    ok &= good
    print(f"  {name}: seed {SEED_BYTES[name]:.5f} ({SEED_BYTES[name] / 2:.3f}"
          f" of BF16), library {lib:.5f} {'ok' if good else 'MISMATCH'}")
  return 0 if ok else 1


# ==========================================================================
# The block


class Tap(nnx.Module):
  """Wraps a projection; tags its input so the residual analysis finds it."""

  def __init__(self, layer: nnx.Module, name: str, dtype=None):
    self.layer = layer
    self.name = name
    self.dtype = dtype  # cast first (the GEMM's compute dtype), if given

  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(self.dtype)
    return self.layer(checkpoint_name(x, TAG + self.name))


class FusedAttention(models.Attention):
  """`models.Attention` with its core under ``jax.checkpoint`` (flash-like)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = self.n_heads
    split = lambda y: y.reshape(b, t, h, d // h)
    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    dtype = self.dtype

    @jax.checkpoint
    def core(q, k, v):
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
      scores = scores / jnp.sqrt(jnp.float32(d // h))
      causal = jnp.tril(jnp.ones((t, t), dtype=bool))
      scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
      probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
      return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)

    return self.o(core(q, k, v))


def build_block(cfg: models.TransformerConfig, attention: str,
                seed: int = 0) -> nnx.Module:
  """A stock block (every projection an ``nnx.Linear``), inputs tagged."""
  rngs = nnx.Rngs(params=seed)
  block = models.Block(cfg, rngs=rngs)
  if attention == "fused":
    block.attn = FusedAttention(cfg, rngs=rngs)
  for name in ("q", "k", "v", "o"):
    setattr(block.attn, name, Tap(getattr(block.attn, name), name))
  for name in ("up", "down"):
    setattr(block, name, Tap(getattr(block, name), name))
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


# ==========================================================================
# Residual analysis


_GEMM_PRIMITIVES = {"dot_general", "ffi_call", "custom_call", "scaled_dot",
                    "ragged_dot_general", "conv_general_dilated"}


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (list, tuple)) else (v,)):
      if isinstance(j, jex_core.ClosedJaxpr):
        yield j.jaxpr
      elif isinstance(j, jex_core.Jaxpr):
        yield j


def _has_gemm(eqn, memo: dict) -> bool:
  key = id(eqn)
  if key not in memo:
    memo[key] = eqn.primitive.name in _GEMM_PRIMITIVES or any(
        _has_gemm(e, memo) for j in _sub_jaxprs(eqn) for e in j.eqns)
  return memo[key]


def _frames(eqn) -> list[tuple[str, str, int]]:
  tb = eqn.source_info.traceback
  if tb is None:
    return []
  return [(f.file_name, f.function_name, f.line_num) for f in tb.frames]


def _where(eqn) -> str:
  """The innermost frame outside JAX, as ``file:line (function)``."""
  for file, fn, line in _frames(eqn):
    if "/jax/" in file or "/jax_" in file:
      continue
    return f"{_short(file)}:{line} ({fn})"
  return "?"


def _short(file: str) -> str:
  if "site-packages/" in file:
    return file.split("site-packages/", 1)[1]
  root = str(_HERE.parent) + "/"
  if file.startswith(root):
    return file[len(root):]
  return file


def _category(eqn) -> str:
  frames = _frames(eqn)
  files = [f for f, _, _ in frames]
  fns = [fn for _, fn, _ in frames]
  if any(f.endswith("normalization.py") for f in files):
    return "layernorm"
  if any("Attention" in fn or fn == "core" for fn in fns):
    return "attention"
  if any(fn.startswith("Block.") for fn in fns):
    return "mlp (GELU)"
  return "other activations"


_QUANT_DTYPES = ("float8", "uint8", "int8", "float4")


def _is_quant_dtype(dt) -> bool:
  return any(str(dt).startswith(p) for p in _QUANT_DTYPES)


@dataclasses.dataclass
class Residual:
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  category: str
  layers: tuple[str, ...]
  source: str


def residuals(f, *args, diff_argnums=(0, 2)) -> list[Residual]:
  """Every residual of ``jax.vjp(f, args[diff_argnums])`` with its origin."""
  def primal(*diff):
    full = list(args)
    for i, a in zip(diff_argnums, diff):
      full[i] = a
    return f(*full)

  def vjp_of(*diff):
    return jax.vjp(primal, *diff)

  diff = [args[i] for i in diff_argnums]
  leaves, tree = jax.tree.flatten(diff)
  closed, shape = jax.make_jaxpr(
      lambda *ls: vjp_of(*jax.tree.unflatten(tree, ls)),
      return_shape=True)(*leaves)
  jaxpr = closed.jaxpr
  n_res = len(jax.tree.leaves(shape[1]))
  res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res:]
  names = _leaf_names(diff)
  x_vars = {v for v, n in zip(jaxpr.invars, names) if n.startswith("x")}

  # Forward dataflow over the top-level equations: which tagged projection
  # inputs a value is computed from with no GEMM on any path since the tag
  # (so a scale folded into a GEMM output does not count), and whether it
  # depends on the block input at all.
  tags: dict[Any, frozenset] = {}
  after_gemm: set = set()  # downstream of a GEMM since the last tag
  dep_x: set = set(x_vars)
  producer: dict[Any, Any] = {}
  memo: dict = {}
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if isinstance(v, jex_core.Var)]
    for v in eqn.outvars:
      producer[v] = eqn
    if any(v in dep_x for v in ins):
      dep_x.update(eqn.outvars)
    if eqn.primitive.name == "name" and str(
        eqn.params.get("name", "")).startswith(TAG):
      t, after = frozenset([eqn.params["name"][len(TAG):]]), False
    elif _has_gemm(eqn, memo):
      t, after = frozenset(), True
    else:
      t = frozenset().union(*(tags.get(v, frozenset()) for v in ins))
      after = any(v in after_gemm for v in ins)
    for v in eqn.outvars:
      tags[v] = frozenset() if after else t
      if after:
        after_gemm.add(v)

  invar_name = dict(zip(jaxpr.invars, names))
  out = []
  for v in res_vars:
    aval = v.aval
    nbytes = _nbytes(aval)
    row = Residual(tuple(aval.shape), str(aval.dtype), nbytes, "", (), "")
    if not isinstance(v, jex_core.Var):
      row.category, row.source = "scalars/constants", "literal"
    elif v in invar_name:
      n = invar_name[v]
      row.category = ("block input x" if n.startswith("x")
                      else "params (saved as is)")
      row.source = n
    elif v in jaxpr.constvars or v not in producer:
      row.category, row.source = "scalars/constants", "constant"
    else:
      eqn = producer[v]
      row.source = f"{eqn.primitive.name} @ {_where(eqn)}"
      row.layers = tuple(sorted(tags.get(v, ())))
      if row.layers:
        row.category = "GEMM inputs"
      elif nbytes <= 4096:
        row.category = "scalars/constants"
      elif v not in dep_x:
        row.category = "weight copies"
      else:
        row.category = _category(eqn)
    out.append(row)
  return out


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def _leaf_names(diff) -> list[str]:
  params, x = diff
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    names.append("p" + jax.tree_util.keystr(path))
  names += ["x"] * len(jax.tree.leaves(x))
  return names


def gemm_input_kind(r: Residual) -> str:
  """payload / scales / wide copy, for a GEMM-input residual."""
  if "float8" in r.dtype:
    return "payload"
  if "scale" in r.source or r.nbytes <= 4096:
    return "scales"
  if r.dtype == "uint8":
    return "payload"
  return f"wide {r.dtype}"


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


def _split(block):
  gd, params, rest = nnx.split(block, nnx.Param, ...)
  return gd, nnx.as_pure(params), nnx.as_pure(rest)


def _block_input(cfg: models.TransformerConfig, dtype) -> jax.Array:
  return jax.random.normal(jax.random.key(1),
                           (cfg.batch, cfg.seq_len, cfg.d_model), dtype)


def _compile(f, params, rest, x):
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


def _grouped(leaves) -> list[dict]:
  """``(fields, nbytes)`` pairs merged by equal fields, largest first."""
  groups: dict[tuple, dict] = {}
  for fields, nbytes in leaves:
    key = tuple(tuple(v) if isinstance(v, list) else v
                for v in fields.values())
    g = groups.setdefault(key, {**fields, "count": 0, "bytes": 0})
    g["count"] += 1
    g["bytes"] += nbytes
  return sorted(groups.values(), key=lambda g: -g["bytes"])


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
  if rec.quantized and rec.save_quantized_wgrad_input and rec.wgrad.lhs:
    bpe = scaling.bytes_per_element(rec.wgrad.lhs)
  else:
    bpe = float(np.dtype(rec.dtype).itemsize)
  cfg = dataclasses.replace(cfg, dtype=rec.dtype)
  m = Measurement(label, recipe_name, save, bpe, "")
  try:
    block = build_block(cfg, attention)
    m.conversion = convert(block, rec)
    gd, params, rest = _split(block)
    x = _block_input(cfg, stream_dtype)

    def f(p, r, x):
      return nnx.merge(gd, p, r)(x)

    res, step, m.compile_s = _compile(f, params, rest, x)
    m.residual_out_bytes = int(res.output_size_in_bytes)
    m.step_temp_bytes = int(step.temp_size_in_bytes)
    m.step_out_bytes = int(step.output_size_in_bytes)

    rows = residuals(f, params, rest, x)
    m.residual_sum_bytes = sum(r.nbytes for r in rows)
    for r in rows:
      m.by_category[r.category] = m.by_category.get(r.category, 0) + r.nbytes
      if r.category == "GEMM inputs":
        k = gemm_input_kind(r)
        m.gemm_in_by_kind[k] = m.gemm_in_by_kind.get(k, 0) + r.nbytes
    m.leaves = _grouped(
        ({"category": r.category, "dtype": r.dtype, "shape": list(r.shape),
          "source": r.source, "layers": list(r.layers)}, r.nbytes)
        for r in rows)
  except Exception as e:  # noqa: BLE001 - reported in the table
    m.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  return m


# ==========================================================================
# Reporting


CATEGORIES = ("GEMM inputs", "layernorm", "attention", "mlp (GELU)",
              "block input x", "other activations", "scalars/constants",
              "weight copies", "params (saved as is)")


def _mib(b: float) -> str:
  return f"{b / MiB:.1f}"


def _target_key(m: Measurement) -> str | None:
  if m.save_quantized is not True:
    return None
  if m.bytes_per_elem <= 0.6:
    return "mxfp4"
  if m.bytes_per_elem <= 1.05:
    return "fp8"
  return None


def _verdict(ratio: float, target: float) -> str:
  return "met" if ratio <= target else "MISSED"


def _shape(shape) -> str:
  return "x".join(map(str, shape))


def _failed(m, columns: int) -> str:
  """The table row of a failed measurement: label, error, blank cells."""
  return mdtable.row(m.label, f"failed: {m.error.replace('|', '/')}",
                     *[None] * (columns - 2))


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
      lines.append(_failed(m, 13))
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
      target = (f"≤{t:.2f}: activations {_verdict(act_ratio, t)}, GEMM "
                f"inputs {_verdict(gemm / b_gemm, t)}")
    lines.append(mdtable.row(
        m.label, _mib(m.residual_out_bytes),
        f"{m.residual_out_bytes / b_res:.3f}", _mib(m.activation_bytes),
        f"{act_ratio:.3f}", f"{pred_act:.3f}", _mib(gemm),
        f"{gemm / b_gemm:.3f}", f"{m.bytes_per_elem / 2:.3f}",
        _mib(weights), _mib(m.step_temp_bytes),
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
    lines.append(mdtable.row(c, *(_mib(m.by_category.get(c, 0)) for m in ok)))
  kinds = sorted({k for m in ok for k in m.gemm_in_by_kind})
  for k in kinds:
    lines.append(mdtable.row(f"GEMM inputs: {k}", *(
        _mib(m.gemm_in_by_kind.get(k, 0)) for m in ok)))
  lines.append(mdtable.row("sum of residual leaves", *(
      _mib(m.residual_sum_bytes) for m in ok)))
  return "\n".join(lines) + "\n"


def render_leaves(m: Measurement, min_share: float = 0.002) -> str:
  """The residual leaves of ``m`` grouped by origin, largest first."""
  lines = [f"Residual leaves of {m.label} (grouped by category, dtype, shape "
           "and producing op; largest first):", "",
           *mdtable.head(["category", "layers", "dtype", "shape", "count",
                          "MiB", "produced by"], "llllrrl")]
  total = sum(g["bytes"] for g in m.leaves) or 1
  top = sum(1 for g in m.leaves if g["bytes"] >= min_share * total)
  for g in m.leaves[:top]:
    lines.append(mdtable.row(
        g["category"], ",".join(g["layers"]), g["dtype"],
        _shape(g["shape"]) or "scalar", g["count"],
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
                 + ", ".join(f"{k} {_mib(v)} MiB" for k, v in wide.items()))
    expect = b_gemm * m.bytes_per_elem / 2
    if m.save_quantized and gemm > 1.02 * expect:
      out.append(f"{m.label}: GEMM-input bytes {_mib(gemm)} MiB exceed the "
                 f"seed arithmetic {_mib(expect)} MiB by "
                 f"{gemm / expect - 1:.1%}")
    wc = [g for g in m.leaves if g["category"] == "weight copies"
          and not _is_quant_dtype(g["dtype"]) and g["bytes"] > 4096]
    if wc:
      out.append(f"{m.label}: saves wide weight copies: " + ", ".join(
          f"{g['dtype']}[{_shape(g['shape'])}] x{g['count']} "
          f"({g['source']})" for g in wc))
  return out


# ==========================================================================
# Remat: jax.checkpoint with a names-only policy


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


def _remat_kind(desc: str, nbytes: int) -> str:
  from qlayers.ops import WGRAD_INPUT_NAME
  if desc.startswith("from the argument x"):
    return "block input"
  if desc.startswith("from the argument"):
    return "params (saved as is)"
  if f"named '{WGRAD_INPUT_NAME}'" in desc or f"named '{TAG}" in desc:
    return "GEMM inputs"
  return "scalars/constants" if nbytes <= 4096 else "other"


def measure_remat(cfg: models.TransformerConfig, recipe_name: str,
                  policy_kind: str, stream_dtype) -> RematMeasurement:
  """Residual bytes of the block under ``jax.checkpoint(policy)``."""
  import qlayers
  from jax._src.ad_checkpoint import saved_residuals
  from qlayers import scaling
  rec = qlayers.recipe(recipe_name)
  if rec.quantized:
    names, label = (), f"{recipe_name}: qlayers.remat_policy()"
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
    block = build_block(cfg, "materialized")
    block.attn = Tap(block.attn, QKV)
    # Name what each GEMM consumes: its input in the compute dtype (the
    # linears would cast the FP32 LayerNorm outputs themselves).
    for _, t in nnx.iter_modules(block):
      if isinstance(t, Tap):
        t.dtype = cfg.dtype
    convert(block, rec)
    gd, params, rest = _split(block)
    x = _block_input(cfg, stream_dtype)

    def f(p, r, x):
      return jax.checkpoint(lambda p, x: nnx.merge(gd, p, r)(x),
                            policy=policy)(p, x)

    res, step, m.compile_s = _compile(f, params, rest, x)
    m.residual_out_bytes = int(res.output_size_in_bytes)
    m.step_temp_bytes = int(step.temp_size_in_bytes)

    leaves = []
    for aval, desc in saved_residuals(lambda p, x: f(p, rest, x), params, x):
      nbytes = _nbytes(aval)
      kind = _remat_kind(desc, nbytes)
      m.by_kind[kind] = m.by_kind.get(kind, 0) + nbytes
      src = desc.split(" from ")[0] if "named" in desc else desc
      leaves.append(({"kind": kind, "dtype": str(aval.dtype),
                      "shape": list(aval.shape), "source": src}, nbytes))
    m.leaves = _grouped(leaves)
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
      lines.append(_failed(m, 9))
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
      v = [f"≤{t:.2f}: GEMM inputs {_verdict(r1[0], t)}/"
           f"{_verdict(r1[-1], t)}, + block input {_verdict(r2[0], t)}/"
           f"{_verdict(r2[-1], t)}"]
    lines.append(mdtable.row(
        m.label, _mib(m.gemm_inputs), _mib(m.get("block input")),
        _mib(m.get("other") + m.get("scalars/constants")),
        _mib(m.residual_out_bytes), _mib(m.step_temp_bytes),
        " / ".join(f"{r:.3f}" for r in r1),
        " / ".join(f"{r:.3f}" for r in r2), "".join(v)))
  return "\n".join(lines) + "\n"


def render_remat_leaves(m: RematMeasurement) -> str:
  lines = [f"Saved under the policy, {m.label}:", "",
           *mdtable.head(["kind", "dtype", "shape", "count", "MiB",
                          "saved as"], "lllrrl")]
  for g in m.leaves:
    lines.append(mdtable.row(g["kind"], g["dtype"],
                             _shape(g["shape"]) or "scalar", g["count"],
                             f"{g['bytes'] / MiB:.2f}", g["source"]))
  return "\n".join(lines) + "\n"


def _remat_cmd(args: argparse.Namespace) -> int:
  import qlayers
  cfg = _block_config(args)
  names = (args.recipes.split(",") if args.recipes else
           [n for n in qlayers.available_recipes()
            if qlayers.recipe(n).quantized])
  names = [n for n in names if n != "bf16"]
  t_start = time.perf_counter()
  report = _start_report(cfg)
  md = []
  for stream_name in args.stream_dtype.split(","):
    stream = jnp.dtype(stream_name)
    results = [measure_remat(cfg, "bf16", pk, stream)
               for pk in ("per projection", "shared")]
    results += [measure_remat(cfg, n, "", stream) for n in names]
    for m in results:
      print(f"[remat {stream_name}] {m.label}: GEMM inputs "
            f"{_mib(m.gemm_inputs)} MiB, block input "
            f"{_mib(m.get('block input'))} MiB ({m.compile_s:.1f}s)"
            + (f" FAILED {m.error}" if m.error else ""),
            file=sys.stderr, flush=True)
    md.append(render_remat(results, cfg, stream))
    for m in results:
      if m.recipe in args.detail.split(",") and not m.error:
        md.append(render_remat_leaves(m))
    report["runs"][stream_name] = [dataclasses.asdict(m) for m in results]
  _finish_report(report, t_start, md, args.json)
  return 0


def _block_cmd(args: argparse.Namespace) -> int:
  import qlayers
  cfg = _block_config(args)
  names = (args.recipes.split(",") if args.recipes
           else qlayers.available_recipes())
  if "bf16" in names:
    names.remove("bf16")
  names.insert(0, "bf16")
  stream = jnp.dtype(args.stream_dtype)
  t_start = time.perf_counter()
  report = _start_report(cfg, stream_dtype=str(stream))
  md = []
  for attention in args.attention.split(","):
    results = []
    for name in names:
      rec = qlayers.recipe(name)
      for save in ((True, False) if rec.quantized else (None,)):
        m = measure(cfg, attention, name, save, stream)
        print(f"[{attention}] {m.label}: residuals "
              f"{_mib(m.residual_out_bytes)} MiB, step temp "
              f"{_mib(m.step_temp_bytes)} MiB ({m.compile_s:.1f}s)"
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
              "besides the quantized one, GEMM-input bytes above the seed "
              "arithmetic, wide weight copies in a quantized recipe): "
              + ("none found" if not f else "") + "\n"
              + "".join(f"- {s}\n" for s in f))
    report["runs"][attention] = [dataclasses.asdict(m) for m in results]
  _finish_report(report, t_start, md, args.json, config=(
      f"block d={cfg.d_model} ff={cfg.d_ff} heads={cfg.n_heads} "
      f"seq={cfg.seq_len} batch={cfg.batch}, compute dtype per recipe, "
      f"FP32 params, residual stream {stream}"))
  return 0


def _block_config(args: argparse.Namespace) -> models.TransformerConfig:
  return models.TransformerConfig(d_model=args.d_model, n_heads=args.heads,
                                  n_layers=1, d_ff=args.d_ff,
                                  seq_len=args.seq, batch=args.batch)


def _start_report(cfg: models.TransformerConfig, **config) -> dict[str, Any]:
  """The JSON report of a block command: config, start, machine, ``runs``."""
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  report: dict[str, Any] = {"config": dataclasses.asdict(cfg) | {
      "dtype": "per recipe", "param_dtype": "float32", **config},
      "started": started, "machine": _machine(), "runs": {}}
  report["config"].pop("n_layers", None)
  return report


def _finish_report(report: dict[str, Any], t_start: float, md: list[str],
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


def _add_block_size(p: argparse.ArgumentParser) -> None:
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--d-ff", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--batch", type=int, default=4)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  b = sub.add_parser("block", help="residual/temp bytes of a block per recipe")
  _add_block_size(b)
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
  r = sub.add_parser("remat", help="saved bytes of a block under "
                     "jax.checkpoint with a names-only policy")
  _add_block_size(r)
  r.add_argument("--stream-dtype", default="float32",
                 help="comma-separated dtypes of the block input")
  r.add_argument("--recipes", default=None,
                 help="comma-separated quantized recipe names (default: all)")
  r.add_argument("--detail", default="bf16,fp8_current,mxfp4",
                 help="recipes whose saved leaves are listed")
  r.add_argument("--json", default=None, metavar="PATH")
  c = sub.add_parser("calc", help="the seed's memory equation")
  c.add_argument("--params", type=float, default=70e9)
  c.add_argument("--fsdp", type=int, default=8)
  c.add_argument("--moments", choices=("fp32", "bf16"), default="fp32")
  c.add_argument("--saved-elems", type=float, default=0.0,
                 help="A_e: saved elements eligible for low precision")
  c.add_argument("--wide-elems", type=float, default=0.0,
                 help="A_h: saved elements that stay BF16")
  c.add_argument("--recipe", default="bf16",
                 help="bf16|fp8|mxfp8|mxfp6|mxfp4 or a qlayers recipe name")
  c.add_argument("--workspace-gb", type=float, default=0.0)
  c.add_argument("--tokens", type=float, default=None,
                 help="add A_e of a transformer: layers x tokens x "
                 "(3 d_model + d_ff) (inputs of QKV, O, up, down)")
  c.add_argument("--layers", type=int, default=1)
  c.add_argument("--d-model", type=int, default=None)
  c.add_argument("--d-ff", type=int, default=None)
  c.add_argument("--check-seed", action="store_true",
                 help="reproduce the seed's figures (70B, FSDP-8)")
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.cmd == "calc":
    return _calc(args)
  if args.cmd == "remat":
    return _remat_cmd(args)
  return _block_cmd(args)


if __name__ == "__main__":
  sys.exit(main())
