"""`sensitivity`: which layers (and GEMMs) a recipe hurts most; rules that
keep them wide.

A copy of the model is converted to the recipe (`qlayers.quantize`), and
every GEMM runs through `masked.masked_matmul`: the library's quantized op
under a variant of the recipe, chosen by a traced mask, that quantizes any
chosen set of (layer, GEMM) and leaves the rest in the recipe's compute
dtype (BF16 for every shipped recipe) with FP32 accumulation, as the
unquantized recipe runs them. One compilation then measures, on the same
batches:

* the unquantized model (nothing quantized) and the fully quantized one;
* each layer quantized alone (its three GEMMs), and each GEMM (Fprop,
  Dgrad, Wgrad) of each layer alone: the change of the loss (forward
  effect; Dgrad and Wgrad do not enter the loss, so their change is zero by
  construction) and the SQNR of the whole parameter gradient against the
  unquantized one (which every GEMM affects);
* the model quantized except the ``k`` layers whose loss rose most, for
  ``k = 1 .. max_wide``: the proposed rules, with their loss against the
  unquantized model and against quantizing everything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers import convert
from qlayers import ops
from qlayers import ragged
from qlayers.inspect import _tap
from qlayers.inspect import masked
from qlayers.inspect import numerics
from qlayers.inspect.report import _grid, dump_json, jsonable
from qlayers.layers.core import QuantGemm, injected_op
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.state import QuantGradState

__all__ = ["sensitivity", "Sensitivity", "Candidate", "Proposal"]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layer (``gemm="all"``) or one GEMM of it quantized alone.

  Attributes:
    path: the layer's module path.
    gemm: ``all``, ``fprop``, ``dgrad`` or ``wgrad``.
    loss: mean loss over the batches.
    loss_delta_pct: its change against the unquantized model, in percent
      (zero for ``dgrad`` and ``wgrad``: they do not enter the loss).
    grad_sqnr_db: SQNR (dB) of the parameter gradient against the
      unquantized model's, over all parameters and batches (None if not
      measured).
  """

  path: str
  gemm: str
  loss: float
  loss_delta_pct: float
  grad_sqnr_db: float | None = None


@dataclasses.dataclass(frozen=True)
class Proposal:
  """The recipe everywhere except the layers ``wide``.

  Attributes:
    wide: module paths kept unquantized.
    loss: mean loss over the batches.
    vs_wide_pct: loss change against the unquantized model (%).
    vs_all_pct: loss change against quantizing every layer (%).
    gap_closed: fraction of the loss gap between quantizing everything and
      nothing that keeping ``wide`` unquantized removes.
    grad_sqnr_db: as for `Candidate`.
    rules: `qlayers.Rule` objects for `qlayers.quantize` (the keep-wide rule
      first, then the rules the model was converted with).
  """

  wide: tuple[str, ...]
  loss: float
  vs_wide_pct: float
  vs_all_pct: float
  gap_closed: float
  grad_sqnr_db: float | None
  rules: tuple[convert.Rule, ...]

  @property
  def pattern(self) -> str:
    """One regex matching exactly the paths in ``wide``."""
    return keep_wide_pattern(self.wide)


def keep_wide_pattern(paths: Iterable[str]) -> str:
  """``^(a|b)$`` for the module paths ``paths``."""
  return "^(" + "|".join(re.escape(p) for p in paths) + ")$"


@dataclasses.dataclass
class Sensitivity:
  """What `sensitivity` measured. ``layers`` is ranked (largest loss
  increase first); ``proposed`` is one of ``proposals`` (see `sensitivity`).
  """

  recipe: str
  compute_dtype: str
  batches: int
  wide_loss: float
  all_loss: float
  all_grad_sqnr_db: float | None
  layers: list[Candidate]
  gemms: list[Candidate]
  proposals: list[Proposal]
  proposed: Proposal | None

  @property
  def all_vs_wide_pct(self) -> float:
    return _pct(self.all_loss, self.wide_loss)

  def rules(self, k: int | None = None) -> tuple[convert.Rule, ...]:
    """Rules of the proposal keeping ``k`` layers wide (None: `proposed`)."""
    return self._proposal(k).rules

  def _proposal(self, k):
    if k is None:
      if self.proposed is None:
        raise ValueError("No proposal: the model has a single layer.")
      return self.proposed
    for p in self.proposals:
      if len(p.wide) == k:
        return p
    raise ValueError(f"No proposal keeps {k} layers wide; measured: "
                     f"{[len(p.wide) for p in self.proposals]}.")

  def table(self) -> str:
    base = self.compute_dtype
    lines = [f"qlayers.inspect.sensitivity: recipe {self.recipe}, "
             f"{self.batches} batches; loss unquantized ({base}) "
             f"{self.wide_loss:.6g}, all quantized {self.all_loss:.6g} "
             f"({self.all_vs_wide_pct:+.3f}%, gradient SQNR "
             f"{_db(self.all_grad_sqnr_db)} dB)"]
    gemms = {(c.path, c.gemm): c for c in self.gemms}
    head = ["rank", "layer", f"Δ loss vs {base} (%)", "grad SQNR dB"]
    if gemms:
      head += ["fprop: Δ loss %", "fprop: grad dB", "dgrad: grad dB",
               "wgrad: grad dB"]
    rows = []
    for i, c in enumerate(self.layers):
      row = [str(i + 1), c.path, f"{c.loss_delta_pct:+.3f}",
             _db(c.grad_sqnr_db)]
      if gemms:
        f, d, w = (gemms.get((c.path, g)) for g in masked.GEMMS)
        row += [f"{f.loss_delta_pct:+.3f}" if f else "-",
                _db(f.grad_sqnr_db) if f else "-",
                _db(d.grad_sqnr_db) if d else "-",
                _db(w.grad_sqnr_db) if w else "-"]
      rows.append(row)
    lines += _grid(head, rows)
    lines.append(f"Keeping the top k layers wide ({self.recipe} elsewhere):")
    lines += _grid(
        ["k", f"loss", f"vs {base} (%)", "vs all quantized (%)",
         "gap closed", "grad SQNR dB", "wide"],
        [[str(len(p.wide)), f"{p.loss:.6g}", f"{p.vs_wide_pct:+.3f}",
          f"{p.vs_all_pct:+.3f}", f"{100 * p.gap_closed:.0f}%",
          _db(p.grad_sqnr_db), ", ".join(p.wide)] for p in self.proposals])
    if self.proposed is not None:
      lines.append(f"proposed: keep {len(self.proposed.wide)} wide: "
                   f"qlayers.Rule(pattern={self.proposed.pattern!r}, "
                   "recipe=None)")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()

  def to_dict(self) -> dict[str, Any]:
    def prop(p):
      d = dataclasses.asdict(p)
      d["rules"] = [{"pattern": r.pattern, "head": r.head,
                     "backend": r.backend, "recipe": _recipe_name(r.recipe)}
                    for r in p.rules]
      d["pattern"] = p.pattern
      return d
    return jsonable({
        "recipe": self.recipe, "compute_dtype": self.compute_dtype,
        "batches": self.batches, "wide_loss": self.wide_loss,
        "all_loss": self.all_loss, "all_vs_wide_pct": self.all_vs_wide_pct,
        "all_grad_sqnr_db": self.all_grad_sqnr_db,
        "layers": [dataclasses.asdict(c) for c in self.layers],
        "gemms": [dataclasses.asdict(c) for c in self.gemms],
        "proposals": [prop(p) for p in self.proposals],
        "proposed": None if self.proposed is None else prop(self.proposed)})

  def to_json(self, path: str | pathlib.Path | None = None) -> str:
    return dump_json(self.to_dict(), path)


def _recipe_name(r) -> str | None:
  """How a rule's recipe is written to JSON: its name or path. A `Recipe`
  that its name no longer loads (changed fields) cannot be written so."""
  if r is None:
    return None
  if not isinstance(r, Recipe):
    return str(r)
  try:
    same = load_recipe(r.name) == r
  except (ValueError, OSError):
    same = False
  if not same:
    raise ValueError(
        f"Recipe {r.name!r} is not the recipe its name loads (changed "
        "fields); rules are saved with recipes by name or path: write it to "
        "a TOML file and give the rule that path.")
  return r.name


def _pct(a: float, b: float) -> float:
  return 100.0 * (a - b) / abs(b) if b else math.nan


def _db(v) -> str:
  if v is None:
    return "-"
  return "inf" if math.isinf(v) and v > 0 else f"{v:.1f}"


# ----------------------------------------------------------------------------
# The masked pass


class _Masked:
  """The tap: the layer of candidate ``i`` quantizes the GEMMs ``mask[i]``
  selects; every other layer runs the real op."""

  def __init__(self, index: dict[str, int], mask, masks):
    self.index, self.mask, self.masks = index, mask, masks

  def __call__(self, site, x, w, recipe, state, *, key=None,
               out_dtype=None, backend=None, **grouped):
    i = self.index.get(_tap.path_of(site))
    if i is None:
      kw = dict(key=key, out_dtype=out_dtype, backend=backend)
      if grouped:  # a grouped GEMM: group_sizes, capacity
        return ragged.quantized_ragged_dot(
            x, w, grouped["group_sizes"], recipe, state,
            capacity=grouped["capacity"], **kw)
      return ops.quantized_matmul(x, w, recipe, state, **kw)
    return masked.masked_matmul(x, w, recipe, state, self.mask[i], key=key,
                                out_dtype=out_dtype, backend=backend,
                                masks=self.masks, **grouped)


def _pass(graphdef, loss_fn, index, masks, state, mask, batch):
  model = nnx.merge(graphdef, state)
  _tap.label(model)

  def loss(m):
    out = loss_fn(m, *batch)
    if not (isinstance(out, jax.Array) and out.shape == ()):
      raise TypeError("loss_fn must return a scalar array (the loss), got "
                      f"{type(out).__name__} {getattr(out, 'shape', '')}.")
    return out.astype(jnp.float32)

  # The gradient amax of delayed recipes is differentiated (as a training
  # step does), then dropped: only the Params' gradients are compared.
  wrt = nnx.DiffState(0, (nnx.Param, QuantGradState))
  with _tap.tapping(_Masked(index, mask, masks)):
    value, grads = nnx.value_and_grad(loss, argnums=wrt)(model)
  return value, nnx.as_pure(nnx.state(grads, nnx.Param))


@jax.jit
def _grad_sqnr(ref, grads) -> jax.Array:
  """SQNR (dB) of ``grads`` against ``ref`` over every leaf of both."""
  ref = jnp.concatenate([jnp.ravel(v).astype(jnp.float32)
                         for v in jax.tree.leaves(ref)])
  got = jnp.concatenate([jnp.ravel(v).astype(jnp.float32)
                         for v in jax.tree.leaves(grads)])
  return numerics.sqnr_db(ref, got)


class _Evaluator:
  """Runs the masked pass on every batch, against the unquantized pass."""

  def __init__(self, graphdef, state, loss_fn, index, n, batches, grads,
               masks):
    # Compiled for this `sensitivity` call only (the mask is traced: one
    # program serves every mask); nothing is cached on ``loss_fn``.
    self.run = jax.jit(functools.partial(_pass, graphdef, loss_fn,
                                         index, masks))
    self.state, self.n = state, n
    self.batches, self.grads = batches, grads
    self.ref = None

  def _pass(self, mask, batch):
    return self.run(self.state, jnp.asarray(mask, jnp.float32), batch)

  def reference(self) -> float:
    """Mean loss with nothing quantized; keeps its gradients (if measured)."""
    out = [self._pass(np.zeros((self.n, 3)), b) for b in self.batches]
    if self.grads:
      self.ref = [g for _, g in out]
    return float(np.mean([float(loss) for loss, _ in out]))

  def __call__(self, mask: np.ndarray) -> tuple[float, float | None]:
    """(mean loss, gradient SQNR or None) with ``mask`` (n_layers, 3).

    The SQNR of several batches is that of their mean noise-to-signal
    ratio (each batch's gradient weighted alike).
    """
    if self.grads and self.ref is None:
      raise RuntimeError("reference() must run first.")
    losses, ratios = [], []
    for i, batch in enumerate(self.batches):
      loss, g = self._pass(mask, batch)
      losses.append(float(loss))
      if self.grads:
        ratios.append(10.0 ** (-float(_grad_sqnr(self.ref[i], g)) / 10.0))
    sqnr = None
    if self.grads:
      mean = float(np.mean(ratios))
      sqnr = math.inf if mean == 0 else -10.0 * math.log10(mean)
    return float(np.mean(losses)), sqnr


def _as_batches(batches) -> list[tuple]:
  if hasattr(batches, "shape"):  # an array iterates over its rows
    raise TypeError(f"batches is one array of shape {batches.shape}; pass a "
                    "list of batches (one batch: [x], or [(x, y)]).")
  if isinstance(batches, tuple) and batches and all(
      hasattr(b, "shape") for b in batches):
    raise TypeError(
        f"batches is a tuple of {len(batches)} arrays; pass a list: "
        "[(x, y)] for one batch of several arrays, [x1, x2] for batches of "
        "one array each.")
  out = [b if isinstance(b, tuple) else (b,) for b in batches]
  if not out:
    raise ValueError("sensitivity needs at least one batch.")
  return out


def _working_copy(model, recipe, rules):
  """A converted copy of ``model``, and the rules it was converted with."""
  work = nnx.clone(model)
  if any(True for _ in _tap.gemm_paths(work)):
    convert.dequantize_model(work)
  rules = convert.DEFAULT_RULES if rules is None else tuple(
      [rules] if isinstance(rules, convert.Rule) else rules)
  report = convert.quantize(work, recipe, rules)
  # Layers with no stock form keep the recipe they were built with: they
  # would be measured (and ranked) under it, not under ``recipe``.
  name = load_recipe(recipe).name
  kept = [f"{s.path or '(model)'} ({s.layer_type}, "
          f"{s.reason.split(';')[0]})"
          for s in report.already_quantized if "not requantized" in s.reason]
  kept += [f"{'/'.join(map(str, p)) or '(model)'} (a stock layer running "
           f"QuantGemm({op.recipe.name!r}) given it by hand)"
           for p, node in nnx.iter_graph(work)
           for op in [getattr(node, injected_op(node) or "", None)]
           if isinstance(op, QuantGemm) and op.recipe.name != name]
  if kept:
    raise ValueError(
        f"sensitivity: {', '.join(kept)} cannot be converted back to a "
        f"stock layer, so it would be measured under its own recipe, not "
        f"{name!r}; build the model from stock layers (qlayers.quantize "
        "converts them) to measure it, or measure it under that recipe.")
  return work, rules


def sensitivity(model: nnx.Module, loss_fn: Callable[..., jax.Array],
                batches: Sequence, recipe: Recipe | str, *,
                rules: convert.Rule | Iterable[convert.Rule] | None = None,
                gemms: bool = True, grads: bool = True,
                max_wide: int | None = None,
                close: float = 0.5) -> Sensitivity:
  """Quantizes one layer (and one GEMM) at a time, ranks the layers by how
  much the loss rises, and proposes rules that keep the worst ones wide.

  Works on a converted copy of ``model`` (``model`` itself does not
  change): a model with stock layers is converted with
  ``qlayers.quantize(copy, recipe, rules)``; a quantized one is first
  converted back (a ValueError names the layers that have no stock form,
  experts built directly or a stock layer given a `QuantGemm` by hand,
  where their recipe is not ``recipe``). Delayed-scaling recipes start
  from an empty history (current amaxes). See the module docstring for
  what is measured.

  Args:
    model: the model, ideally trained (an untrained model's loss says little).
    loss_fn: ``loss_fn(model, *batch) -> scalar``.
    batches: a few batches: tuples of ``loss_fn``'s arguments after the
      model (a non-tuple is one argument).
    recipe: the recipe to measure.
    rules: conversion rules (default `qlayers.convert.DEFAULT_RULES`: the
      embeddings and the output head stay wide).
    gemms: also measure each GEMM of each layer alone (3 more passes per
      layer).
    grads: measure gradient SQNR (keeps the unquantized gradients of every
      batch in memory).
    max_wide: propose keeping up to this many layers wide (default: a
      quarter of the layers, at least 1).
    close: `Sensitivity.proposed` is the smallest proposal that closes this
      fraction of the gap between quantizing everything and nothing (else
      the one that closes most).

  Returns:
    A `Sensitivity`; ``print`` it for the tables.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got "
                    f"{type(model).__name__}.")
  recipe = load_recipe(recipe)
  if not recipe.quantized:
    raise ValueError(f"Recipe {recipe.name!r} quantizes nothing; there is "
                     "nothing to measure.")
  batches = _as_batches(batches)
  work, used_rules = _working_copy(model, recipe, rules)
  labels = [p for p, g in _tap.gemm_paths(work).items()
            if g.recipe.quantized]
  if not labels:
    raise ValueError("No layer of the model was quantized by "
                     f"qlayers.quantize(model, {recipe.name!r}, rules); "
                     "nothing to measure.")
  # The candidates are layers, what a rule keeps wide: a layer of several
  # GEMMs (a Tunix MoE's gate, up and down) is one, its GEMMs masked alike.
  paths = list(dict.fromkeys(map(_tap.rule_path, labels)))
  index = {p: paths.index(_tap.rule_path(p)) for p in labels}
  n = len(paths)
  max_wide = max(1, n // 4) if max_wide is None else max_wide
  if not 1 <= max_wide <= n:
    raise ValueError(f"max_wide must be in [1, {n}], got {max_wide}.")
  graphdef, state = nnx.split(work)
  # The masks a layer gets: none, all, and (with ``gemms``) each GEMM alone.
  masks = ((0, 0, 0), (1, 1, 1))
  if gemms:
    masks += ((1, 0, 0), (0, 1, 0), (0, 0, 1))
  run = _Evaluator(graphdef, state, loss_fn, index, n, batches, grads,
                   masks)

  wide_loss = run.reference()
  all_loss, all_sqnr = run(np.ones((n, 3)))
  if not (math.isfinite(wide_loss) and math.isfinite(all_loss)):
    raise ValueError(
        f"The loss is not finite (unquantized {wide_loss}, all quantized "
        f"{all_loss}): nothing can be ranked; check the batches for NaN/Inf.")

  def candidate(path, gemm, mask):
    loss, sq = run(mask)
    return Candidate(path, gemm, loss, _pct(loss, wide_loss), sq)

  layers, gemm_rows = [], []
  for i, path in enumerate(paths):
    mask = np.zeros((n, 3))
    mask[i] = 1
    layers.append(candidate(path, "all", mask))
    if gemms:
      for j, gemm in enumerate(masked.GEMMS):
        mask = np.zeros((n, 3))
        mask[i, j] = 1
        gemm_rows.append(candidate(path, gemm, mask))
  order = sorted(range(n), key=lambda i: (-layers[i].loss_delta_pct, i))
  layers = [layers[i] for i in order]

  proposals = []
  gap = all_loss - wide_loss
  for k in range(1, max_wide + 1):
    keep = [paths[i] for i in order[:k]]
    mask = np.ones((n, 3))
    mask[order[:k]] = 0
    loss, sq = run(mask)
    keep_rule = convert.Rule(pattern=keep_wide_pattern(keep), recipe=None)
    proposals.append(Proposal(
        wide=tuple(keep), loss=loss, vs_wide_pct=_pct(loss, wide_loss),
        vs_all_pct=_pct(loss, all_loss),
        gap_closed=(all_loss - loss) / gap if gap else math.nan,
        grad_sqnr_db=sq, rules=(keep_rule, *used_rules)))
  proposed = None
  if proposals and n > 1:
    enough = [p for p in proposals if p.gap_closed >= close]
    proposed = enough[0] if enough else max(
        proposals, key=lambda p: (_finite(p.gap_closed), -len(p.wide)))
  return Sensitivity(
      recipe=recipe.name, compute_dtype=recipe.compute_dtype,
      batches=len(batches), wide_loss=wide_loss, all_loss=all_loss,
      all_grad_sqnr_db=all_sqnr, layers=layers, gemms=gemm_rows,
      proposals=proposals, proposed=proposed)


def _finite(v: float) -> float:
  return v if math.isfinite(v) else -math.inf
