"""Model conversion: swap the linear layers of an existing NNX model in place.

`quantize` walks a model, decides per layer by `Rule` (a regex on the module
path, first match wins) which recipe it gets, and replaces each chosen layer
on its parent(s) by its quantized drop-in:

====================  =========================  ==========================
stock layer           quantized drop-in          condition
====================  =========================  ==========================
``nnx.Linear``        `QuantDense`               default ``dot_general``
``nnx.LinearGeneral`` `QuantLinearGeneral`       no ``batch_axis``
``nnx.Einsum``        `QuantEinsum`              equation is one GEMM
``ragged_dot`` attr   `QuantRaggedDot`           stacked kernel [E, K, N]
====================  =========================  ==========================

The Q/K/V and output projections of ``nnx.MultiHeadAttention`` are
``nnx.LinearGeneral`` and convert as such. The new layer adopts the old one's
Variables (the same ``nnx.Param`` objects, so an optimizer or any other
reference still sees the same kernel) and attributes; only the quantization
attribute ``quant`` (its `QuantGemm`: recipe, backend, state) is new. The
output head is found by what the model does (`qlayers.heads`). Walking and
swapping use public Flax functions only (`qlayers.swap`).
`dequantize_model` is the inverse. Both return a `ConversionReport`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Iterable

from flax import nnx

from qlayers import dispatch, swap, swap_experts
from qlayers.heads import output_heads
from qlayers.layers.core import hand_made, seed_rounding
from qlayers.layers.frozen import FREEZABLE, FrozenKernel, freeze_kernels
from qlayers.recipe import Recipe, recipe as load_recipe

__all__ = ["Rule", "DEFAULT_KEEP_WIDE", "KEEP_HEAD_WIDE", "DEFAULT_RULES",
           "ConversionReport",
           "Converted", "KeptWide", "Skipped", "quantize", "dequantize_model"]

DEFAULT_KEEP_WIDE = (r"(^|/)(embed\w*|\w+_embed\w*|wte|wpe|lm_head|head|"
                     r"logits|unembed\w*|classifier)($|/)|^output($|/)")
"""Module paths `quantize` keeps wide by default: embeddings (a path component
``embed*``, ``*_embed*``, ``wte``, ``wpe``) and the output head (``lm_head``,
``head``, ``logits``, ``unembed*``, ``classifier``, or a top-level
``output``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """Which recipe the layers at matching module paths get.

  Attributes:
    pattern: a regular expression searched (``re.search``) in the module path,
      its parts joined by ``/``: ``"blocks/0/mlp/up"``. Anchor it
      (``^...$``, ``(^|/)name($|/)``) to match whole components. The
      default ``""`` matches every path. A layer held under several paths
      (a shared or tied layer) matches where any of them does.
    recipe: a recipe name, path or `Recipe`; ``None`` keeps the layer wide.
      A rule with a recipe that matches an ``nnx.Embed`` quantizes its
      ``attend`` (a tied output head; see `qlayers.layers.QuantEmbed`);
      embeddings are never quantized otherwise.
    backend: force a GEMM backend for these layers (``"xla"``, ``"ffi"``).
    head: match only the model's output head, found by what the model does
      rather than by name (`qlayers.heads`): with ``quantize(...,
      example_input=...)``, the linear layer(s) whose output is the model's
      output, by tracing; without, a linear layer whose N is the vocabulary
      of an ``nnx.Embed`` of the model.

  Example:
    >>> import qlayers
    >>> qlayers.Rule(pattern=r"/attn/", recipe="mxfp8").matches(
    ...     "blocks/0/attn/query")
    True
  """

  pattern: str = ""
  recipe: str | Recipe | None
  backend: str | None = None
  head: bool = False

  def __post_init__(self):
    if not isinstance(self.pattern, str):
      raise TypeError(f"Rule pattern must be a str, got "
                      f"{type(self.pattern).__name__}.")
    try:
      re.compile(self.pattern)
    except re.error as e:
      raise ValueError(f"Rule pattern {self.pattern!r} is not a valid regular "
                       f"expression: {e}.") from None
    if self.recipe is not None:
      if isinstance(self.recipe, os.PathLike):
        object.__setattr__(self, "recipe", os.fspath(self.recipe))
      if not isinstance(self.recipe, (str, Recipe)):
        raise TypeError(f"Rule recipe must be a name, a path, a Recipe or "
                        f"None, got {type(self.recipe).__name__}.")
      load_recipe(self.recipe)
    if self.backend is not None and self.backend not in dispatch.BACKENDS:
      raise ValueError(f"Rule backend must be one of {dispatch.BACKENDS} or "
                       f"None, got {self.backend!r}.")

  def matches(self, path: str, head: str | None = None) -> bool:
    """Whether ``pattern`` occurs in the module path ``path`` (and, for a
    ``head`` rule, the layer is the output head: ``head`` says why)."""
    if self.head and not head:
      return False
    return re.search(self.pattern, path) is not None


def rule_for(rules, paths, head: str = "") -> Rule | None:
  """The first of ``rules`` matching any of ``paths`` (a layer held under
  several: shared, tied), or None."""
  return next((r for r in rules if any(r.matches(p, head) for p in paths)),
              None)


KEEP_HEAD_WIDE = Rule(head=True, recipe=None)
"""Keeps the model's output head wide, whatever its name (see `Rule.head`)."""

DEFAULT_RULES = (Rule(pattern=DEFAULT_KEEP_WIDE, recipe=None), KEEP_HEAD_WIDE)
"""The rules `quantize` applies when given ``rules=None``: embeddings and
output heads by name (`DEFAULT_KEEP_WIDE`), and the output head by what it
is (`KEEP_HEAD_WIDE`)."""


@dataclasses.dataclass(frozen=True)
class Converted:
  """A swapped layer: ``shape`` is its GEMM's ``(K, N)``; ``recipe`` the
  recipe it got (`dequantize_model`: the one it dropped); ``rule`` the
  pattern that chose it (``None``: the default recipe); ``aliases`` further
  paths of the same (shared) layer, all swapped."""

  path: str
  old_type: str
  new_type: str
  shape: tuple[int, int]
  recipe: str
  rule: str | None = None
  aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class KeptWide:
  """A layer left unquantized by a rule (``rule=None``: no rule matched, and
  there was no default recipe or the layer is an embedding, which only a rule
  quantizes); ``why`` says how an output head was found; ``aliases``
  further paths of the same (shared) layer."""

  path: str
  layer_type: str
  rule: str | None
  why: str = ""
  aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A layer left as it is, and why."""

  path: str
  layer_type: str
  reason: str


@dataclasses.dataclass
class ConversionReport:
  """What `quantize` / `dequantize_model` did; ``print`` it for a table.

  Attributes:
    converted: layers swapped.
    kept_wide: layers a rule kept unquantized.
    skipped: layers that could not be swapped, with the reason.
    already_quantized: layers left alone because they already were
      (`quantize`) or were not quantized (`dequantize_model`).
    unmatched_rules: rules that decided no layer (they match no layer path,
      or only layers an earlier rule decided); the built-in `DEFAULT_RULES`
      are never listed.
    head: which rule found the output head, and what it found
      (`qlayers.heads`); empty when no rule asked for it.
    model: the converted model (``model`` itself when ``inplace``).
  """

  operation: str
  converted: list[Converted] = dataclasses.field(default_factory=list)
  kept_wide: list[KeptWide] = dataclasses.field(default_factory=list)
  skipped: list[Skipped] = dataclasses.field(default_factory=list)
  already_quantized: list[Skipped] = dataclasses.field(default_factory=list)
  unmatched_rules: list[Rule] = dataclasses.field(default_factory=list)
  head: str = ""
  model: nnx.Module | None = dataclasses.field(default=None, repr=False,
                                               compare=False)

  def __str__(self) -> str:
    lines = [f"{self.operation}: {len(self.converted)} converted, "
             f"{len(self.kept_wide)} kept wide, {len(self.skipped)} skipped, "
             f"{len(self.already_quantized)} left as they were, "
             f"{len(self.unmatched_rules)} unmatched rules"]
    if self.head:
      lines.append(f"output head, {self.head}")
    def table(title, header, rows):
      if not rows:
        return
      rows = [header] + [[str(c) for c in r] for r in rows]
      widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
      lines.append(f"{title}:")
      for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        lines.append("  " + "  ".join(cells).rstrip())
    table("converted", ["path", "layer", "(K, N)", "recipe", "rule"],
          [[(c.path or "(model)")
            + (f" (= {', '.join(c.aliases)})" if c.aliases else ""),
            f"{c.old_type} -> {c.new_type}", c.shape, c.recipe,
            _rule_str(c.rule, self.operation)] for c in self.converted])
    table("kept wide", ["path", "layer", "rule"],
          [[(k.path or "(model)")
            + (f" (= {', '.join(k.aliases)})" if k.aliases else ""),
            k.layer_type,
            ("no rule matched" if k.rule is None
             else _rule_str(k.rule, self.operation))
            + (f": {k.why}" if k.why else "")] for k in self.kept_wide])
    table("skipped", ["path", "layer", "reason"],
          [[s.path or "(model)", s.layer_type, s.reason] for s in self.skipped])
    table("left as they were", ["path", "layer", "reason"],
          [[s.path or "(model)", s.layer_type, s.reason]
           for s in self.already_quantized])
    table("rules that matched nothing", ["pattern", "recipe"],
          [[_rule_str(_rule_name(r), self.operation), _recipe_name(r.recipe)]
           for r in self.unmatched_rules])
    return "\n".join(lines)


def _rule_str(pattern: str | None, operation: str) -> str:
  if pattern is None:
    return "default recipe" if operation == "qlayers.quantize" else "-"
  if pattern == DEFAULT_KEEP_WIDE:
    return "DEFAULT_KEEP_WIDE"
  if pattern == _HEAD:
    return "output head"
  return repr(pattern)


_HEAD = "<output head>"  # how a head rule is named in the report


def _rule_name(rule: Rule) -> str:
  return _HEAD if rule.head and not rule.pattern else rule.pattern


def _recipe_name(r) -> str:
  if r is None:
    return "None (wide)"
  return r.name if isinstance(r, Recipe) else str(r)


def _root(model, report, want) -> None:
  if want(model):
    report.skipped.append(Skipped(
        "", type(model).__name__, "the model itself is the layer; it has no "
        "parent to swap it on (wrap it in a module, or build the other layer "
        "type directly)"))


def _rules(rules) -> tuple[Rule, ...]:
  if rules is None:
    return DEFAULT_RULES
  if isinstance(rules, Rule):
    return (rules,)
  if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
    raise TypeError("rules must be a Rule, a sequence of Rules or None.")
  rules = tuple(rules)
  for r in rules:
    if not isinstance(r, Rule):
      raise TypeError(f"rules must hold qlayers.Rule objects, got "
                      f"{type(r).__name__}: {r!r}.")
  return rules


def _decide(site, rule, r, head, backend, report, stale, stacked):
  """``(site, recipe, backend, (K, N), rule)`` if the layer at ``site`` is to
  be swapped for recipe ``r``; otherwise records why not (in ``stale`` the
  paths of layers a rule gives another recipe than the one they keep) and
  returns None. ``stacked``: ids of the experts modules whose kernels are
  stacks of layers (`swap_experts.stacks`)."""
  layer, kind = site.layer, type(site.layer).__name__
  name = None if rule is None else _rule_name(rule)
  if swap.is_quantized(layer) or swap_experts.is_quantized(layer):
    done = getattr(layer, "quant", None) or layer.ragged_dot
    other = r is not None and r != done.recipe
    undo = ("dequantize_model first" if type(layer) in swap.STOCK_OF
            or swap_experts.is_quantized(layer) else
            "it has no stock layer to return to: rebuild the model")
    report.already_quantized.append(Skipped(
        site.path, kind, f"already quantized ({done.recipe.name})" + (
            f"; not requantized as {r.name} ({undo})" if other else "")))
    if other and rule is not None and rule.recipe is not None:
      stale.append(site.path or "(model)")  # a rule asked for it: warned
    return None
  if isinstance(layer, nnx.Embed) and (rule is None or rule.recipe is None):
    if head:  # a tied output head: listed; embeddings are silent otherwise
      report.kept_wide.append(KeptWide(site.path, kind, name, head,
                                       site.paths[1:]))
    return None
  if r is None:
    report.kept_wide.append(KeptWide(site.path, kind, name, head,
                                     site.paths[1:]))
    return None
  try:
    moe = swap_experts.is_experts(layer)
    shape = (swap_experts.check(layer, r, id(layer) in stacked) if moe
             else swap.check(layer, r))
    why = None if moe else swap.immutable_ref(site)
    if why:
      raise swap.Skip(why)
  except swap.Skip as e:
    report.skipped.append(Skipped(site.path, kind, str(e)))
    return None
  backend = rule.backend if rule is not None and rule.backend else backend
  return site, r, backend, shape, rule


def strict_error(bad, paths) -> ValueError:
  """The error of ``strict=True`` for the rules ``bad``, listing the layer
  ``paths`` the rules were matched against."""
  return ValueError(
      "qlayers.quantize(strict=True): these rules decide no layer: "
      + "; ".join(f"{_rule_name(r)!r} -> {_recipe_name(r.recipe)}"
                  for r in bad)
      + ". Nothing was changed. Layer paths: " + ", ".join(paths) + ".")


# Params named like lookup tables (embeddings, positions), not matmul weights.
_TABLE_NAME = re.compile(r"emb|pos|wpe|wte|table|cache", re.IGNORECASE)


def quantize(model: nnx.Module, recipe: Recipe | str | None,
             rules: Rule | Iterable[Rule] | None = None, *,
             example_input=None, backend: str | None = None,
             strict: bool = False, inplace: bool = True,
             frozen: bool = False) -> ConversionReport:
  """Swaps the linear layers of ``model`` for quantized drop-ins, in place.

  Each ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` (see the module
  docstring) is decided by the first rule that matches it (its pattern occurs
  in the module path; a ``head`` rule also needs the layer to be the output
  head): that rule's recipe, or kept wide for ``recipe=None``. Layers no rule
  matches get ``recipe`` (``None``: left as they are). An ``nnx.Embed``
  becomes a `qlayers.layers.QuantEmbed` (its tied ``attend`` quantized) only
  when a rule with a recipe matches it. A chosen layer is skipped, with the
  reason in the report, when it cannot take the recipe: K or N smaller than
  one scaling block (tile/block: 128, MX: 32), not one GEMM (``batch_axis``,
  a batched einsum), a subclass of a stock layer, an injected
  ``dot_general`` / ``einsum_op``, or held in a tuple. Modules that own a
  matmul weight but are none of these (``nnx.Conv``, a hand-written linear)
  are reported as not converted. Layers already quantized are left alone; a
  layer shared by several parents is swapped everywhere. Each GEMM with
  step-keyed stochastic rounding (nvfp4) gets a seed from its module path
  (`qlayers.recipe_rules.seed_rounding`).

  Args:
    model: the model (an ``nnx.Module``).
    recipe: the recipe of layers no rule decides (name, path, `Recipe`), or
      ``None``.
    rules: `Rule` objects, first match wins. ``None`` uses `DEFAULT_RULES`:
      embeddings and output heads wide, by name (`DEFAULT_KEEP_WIDE`) and by
      what they do (`KEEP_HEAD_WIDE`). Explicit rules replace the defaults:
      append ``*qlayers.convert.DEFAULT_RULES`` to keep them.
    example_input: an input of the model (arrays or ``jax.ShapeDtypeStruct``;
      a tuple is several positional arguments). The model is traced on it,
      without computing, to find the output head by what it does; without
      it the head is found by shape (`qlayers.heads`). ``report.head`` says
      which.
    backend: GEMM backend for layers no rule gives one.
    strict: raise ValueError, before changing anything, if a rule decides no
      layer (the built-in `DEFAULT_RULES` are exempt).
    inplace: convert ``model`` itself (default) or a copy (``nnx.clone``,
      which has its own Params); the report's ``model`` is the result.
    frozen: then hold the kernel of every QuantDense / QuantLinearGeneral
      of the model as quantized payload + scales
      (`qlayers.freeze`: no master, gradient or optimizer state), for LoRA
      fine-tuning (`qlayers.add_lora`).

  Returns:
    A `ConversionReport`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.score = nnx.Linear(128, 10, rngs=rngs)
    ...     self.up = nnx.Linear(64, 128, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.score(nnx.relu(self.up(x)))
    >>> net = Net(nnx.Rngs(0))
    >>> report = qlayers.quantize(net, "fp8_delayed",
    ...                           example_input=jnp.ones((2, 64)))
    >>> [c.path for c in report.converted], [k.path for k in report.kept_wide]
    (['up'], ['score'])
    >>> report.head
    'by tracing example_input: score'
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(model).__name__}.")
  default = None if recipe is None else load_recipe(recipe)
  rules = _rules(rules)
  if backend is not None and backend not in dispatch.BACKENDS:
    raise ValueError(f"backend must be one of {dispatch.BACKENDS} or None, "
                     f"got {backend!r}.")
  resolved = {id(r): None if r.recipe is None else load_recipe(r.recipe)
              for r in rules}
  if not inplace:
    model = nnx.clone(model)
  report = ConversionReport("qlayers.quantize", model=model)
  _root(model, report, lambda m: isinstance(m, swap.STOCK)
        or swap.is_quantized(m))
  sites = swap.sites(model, swap.is_gemm)
  heads = {}
  if example_input is not None or any(r.head for r in rules):
    heads, report.head = output_heads(
        model, [s.layer for s in sites], {id(s.layer): s.path for s in sites},
        example_input)
  # MoE experts holding their grouped GEMM (`qlayers.swap_experts`); the
  # routers beside them stay wide unless a rule decides them.
  experts = swap_experts.sites(model)
  moe = experts + [s for s in sites if swap_experts.is_experts_layer(s.layer)]
  stacked = swap_experts.stacks(sites, moe)
  routers = swap_experts.routers(sites, moe, stacked)
  plan, used, stale = [], set(), []
  for site in sites + experts:
    head = heads.get(id(site.layer), "")
    rule = rule_for(rules, site.paths, head)
    used.add(id(rule))
    r = default if rule is None else resolved[id(rule)]
    if rule is None and id(site.layer) in routers:
      r, head = None, routers[id(site.layer)]
    plan.append(_decide(site, rule, r, head, backend, report, stale,
                        stacked))
  # The built-in rules are a safety net, not something the user asked for:
  # a model without an embedding or head must not read as a rule mistake.
  if stale:
    warnings.warn(
        f"qlayers.quantize: {len(stale)} layers a rule gives a recipe are "
        f"quantized already with another and keep it ({', '.join(stale[:3])}"
        f"{', ...' if len(stale) > 3 else ''}); to requantize them, call "
        "qlayers.dequantize_model(model) first.", stacklevel=2)
  report.unmatched_rules = [r for r in rules if id(r) not in used
                            and r not in DEFAULT_RULES]
  if strict and report.unmatched_rules:
    raise strict_error(report.unmatched_rules, [
        p for s in swap.sites(model, lambda m: isinstance(m, swap.STOCK))
        for p in s.paths])
  if frozen:
    _check_freezable(model, filter(None, plan))
  made = []  # the GEMMs this call creates
  for site, r, b, shape, rule in filter(None, plan):
    if swap_experts.is_experts(site.layer):
      made.append(swap_experts.quantize(site.layer, r, b))
      new = "QuantRaggedDot at .ragged_dot"
    else:
      q = swap.quantized(site.layer, r, b)
      made.append(q.quant)
      new = type(q).__name__
      swap.replace(site, q)
    report.converted.append(Converted(
        site.path, type(site.layer).__name__, new, shape, r.name,
        None if rule is None else _rule_name(rule), site.paths[1:]))
  report.skipped.extend(Skipped(*s) for s in swap.unconverted_matmuls(
      model, _TABLE_NAME, {id(s.layer) for s in experts}))
  # Step-keyed stochastic rounding: a seed per GEMM converted here (the
  # layers left as they were keep theirs).
  seed_rounding(model, only=made)
  if frozen:
    freeze_kernels(model)
  return report


def _check_freezable(model: nnx.Module, plan) -> None:
  """``quantize(..., frozen=True)``'s check, before anything is swapped:
  every kernel `freeze` will store needs a recipe that quantizes weights,
  rounded to nearest (`freeze` takes a key for stochastic rounding)."""
  # (label, recipe) of every kernel freeze will store: the layers about to
  # be swapped, and the qlayers layers already there.
  kernels = [(site.path, r) for site, r, *_ in plan
             if not swap_experts.is_experts(site.layer)]
  kernels += [("/".join(map(str, path)), node.recipe)
              for path, node in nnx.iter_graph(model)
              if isinstance(node, FREEZABLE)
              and isinstance(node.kernel, nnx.Param)]
  wide = [f"{p} ({r.name})" for p, r in kernels if r.fprop.rhs is None]
  drawn = [f"{p} ({r.name})" for p, r in kernels
           if r.fprop.rhs is not None and r.fprop.rhs.stochastic]
  if drawn:
    raise ValueError(
        f"quantize(..., frozen=True): {', '.join(drawn)} would store its "
        "kernel with stochastic rounding, which draws from a PRNG key; "
        "nothing was changed. Quantize without frozen= and then call "
        "qlayers.freeze(model, key=jax.random.key(...)).")
  if wide:
    raise ValueError(
        f"quantize(..., frozen=True): {', '.join(wide)} would run a recipe "
        "that quantizes no weight, so there is no format to freeze them in; "
        "nothing was changed. Keep such layers stock (a Rule with recipe "
        "None), or quantize without frozen= and then call qlayers.freeze("
        "model, spec=QuantSpec(...)), which stores every kernel in that "
        "spec.")


def dequantize_model(model: nnx.Module, *,
                     inplace: bool = True) -> ConversionReport:
  """Swaps `QuantDense` / `QuantLinearGeneral` / `QuantEinsum` back to stock.

  The inverse of `quantize`: each becomes ``nnx.Linear`` /
  ``nnx.LinearGeneral`` / ``nnx.Einsum`` with the same Params (the same
  Variable objects) and hyperparameters; its recipe, backend and
  quantization state are dropped. A frozen kernel (`qlayers.freeze`,
  ``quantize(..., frozen=True)``) comes back as a kernel Param holding its
  dequantized values, in the dtype it was frozen from. Other quantized
  layers are left as they are (reported).

  Args:
    model: the model.
    inplace: convert ``model`` itself (default) or a copy (``nnx.clone``).

  Returns:
    A `ConversionReport` (``recipe`` of each entry: the recipe dropped).

  Example:
    >>> from flax import nnx
    >>> import qlayers
    >>> net = nnx.Sequential(qlayers.QuantDense(8, 8, rngs=nnx.Rngs(0)))
    >>> _ = qlayers.dequantize_model(net)
    >>> type(net.layers[0]).__name__
    'Linear'
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(model).__name__}.")
  if not inplace:
    model = nnx.clone(model)
  report = ConversionReport("qlayers.dequantize_model", model=model)
  _root(model, report, swap.is_quantized)
  plan = []
  for site in swap.sites(model, swap.is_quantized):
    layer, kind = site.layer, type(site.layer).__name__
    if type(layer) not in swap.STOCK_OF:
      report.already_quantized.append(Skipped(
          site.path, kind, "no stock layer to return to"))
    elif why := swap.immutable_ref(site):
      report.skipped.append(Skipped(site.path, kind, why))
    elif getattr(layer, "lora", None) is not None:
      report.skipped.append(Skipped(
          site.path, kind, "holds a LoRA adapter, which the stock layer "
          "would not call: merge it first (qlayers.merge_lora)"))
    else:
      plan.append(site)
  for site in plan:
    layer = site.layer
    stock = swap.stock(layer)
    if isinstance(getattr(layer, "kernel", None), FrozenKernel):
      stock.kernel = nnx.Param(layer.kernel.dequantize())
    swap.replace(site, stock)
    report.converted.append(Converted(
        site.path, type(layer).__name__, swap.STOCK_OF[type(layer)].__name__,
        swap.dims(layer), layer.recipe.name, None, site.paths[1:]))
  report.skipped.extend(Skipped(
      p, "stock layer", "runs a QuantGemm given it by hand: set its "
      "dot_general / einsum_op back to jax's") for p in hand_made(model))
  for site in filter(lambda s: swap_experts.is_quantized(s.layer),
                     swap_experts.sites(model)):
    name = site.layer.ragged_dot.recipe.name
    swap_experts.dequantize(site.layer)
    report.converted.append(Converted(
        site.path, type(site.layer).__name__, "jax.lax.ragged_dot at "
        ".ragged_dot", swap_experts.dims(site.layer), name))
  return report
