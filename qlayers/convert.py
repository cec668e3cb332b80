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
====================  =========================  ==========================

The Q/K/V and output projections of ``nnx.MultiHeadAttention`` are
``nnx.LinearGeneral`` and convert as such. The new layer adopts the old one's
Variables (the same ``nnx.Param`` objects, so an optimizer or any other
reference still sees the same kernel) and attributes; only the quantization
attribute ``quant`` (its `QuantGemm`: recipe, backend, state) is new. To build it without
initialising a second copy of the weights, the drop-in is constructed through
its normal constructor with size-1 features and zero initialisers (a few
bytes of throwaway Params, no random numbers), and then takes over the
original's Variables and hyperparameters; no Flax internals are bypassed.
`dequantize_model` is the inverse. Both return a `ConversionReport`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from qlayers import dispatch
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.layers.dense import QuantDense
from qlayers.layers.embed import QuantEmbed
from qlayers.layers.general import (QuantEinsum, QuantLinearGeneral,
                                    einsum_gemm_plan)
from qlayers.recipe import Recipe, recipe as load_recipe

__all__ = ["Rule", "DEFAULT_KEEP_WIDE", "KEEP_HEAD_WIDE", "DEFAULT_RULES",
           "ConversionReport",
           "Converted", "KeptWide", "Skipped", "quantize", "dequantize_model"]

DEFAULT_KEEP_WIDE = (r"(^|/)(embed\w*|\w+_embed\w*|wte|wpe|lm_head|head|"
                     r"logits|unembed\w*)($|/)|^output($|/)")
"""Module paths `quantize` keeps wide by default: embeddings (a path component
``embed*``, ``*_embed*``, ``wte``, ``wpe``) and the output head (``lm_head``,
``head``, ``logits``, ``unembed*``, or a top-level ``output``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """Which recipe the layers at matching module paths get.

  Attributes:
    pattern: a regular expression searched (``re.search``) in the module path,
      its parts joined by ``/``: ``"blocks/0/mlp/up"``. Anchor it
      (``^...$``, ``(^|/)name($|/)``) to match whole components. The
      default ``""`` matches every path.
    recipe: a recipe name, path or `Recipe`; ``None`` keeps the layer wide.
      A rule with a recipe that matches an ``nnx.Embed`` quantizes its
      ``attend`` (a tied output head; see `qlayers.layers.QuantEmbed`);
      embeddings are never quantized otherwise.
    backend: force a GEMM backend for these layers (``"xla"``, ``"ffi"``).
    head: match only the model's output head, found by what it is rather
      than by name: a linear layer whose N is the vocabulary size of an
      ``nnx.Embed`` of the model, or else the last linear layer defined
      whose N features feed no other linear layer (the classifier of a
      ViT, the ``output_layer`` of a GPT).

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


KEEP_HEAD_WIDE = Rule(head=True, recipe=None)
"""Keeps the model's output head wide, whatever its name (see `Rule.head`)."""

DEFAULT_RULES = (Rule(pattern=DEFAULT_KEEP_WIDE, recipe=None), KEEP_HEAD_WIDE)
"""The rules `quantize` applies when given ``rules=None``: embeddings and
output heads by name (`DEFAULT_KEEP_WIDE`), and the output head by what it
is (`KEEP_HEAD_WIDE`)."""


# ----------------------------------------------------------------------------
# The report


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
  """A layer left unquantized by a rule (``rule=None``: no rule matched and
  there was no default recipe); ``why`` says how an output head was found."""

  path: str
  layer_type: str
  rule: str | None
  why: str = ""


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
    model: the converted model (``model`` itself when ``inplace``).
  """

  operation: str
  converted: list[Converted] = dataclasses.field(default_factory=list)
  kept_wide: list[KeptWide] = dataclasses.field(default_factory=list)
  skipped: list[Skipped] = dataclasses.field(default_factory=list)
  already_quantized: list[Skipped] = dataclasses.field(default_factory=list)
  unmatched_rules: list[Rule] = dataclasses.field(default_factory=list)
  model: nnx.Module | None = dataclasses.field(default=None, repr=False,
                                               compare=False)

  def __str__(self) -> str:
    lines = [f"{self.operation}: {len(self.converted)} converted, "
             f"{len(self.kept_wide)} kept wide, {len(self.skipped)} skipped, "
             f"{len(self.already_quantized)} left as they were, "
             f"{len(self.unmatched_rules)} unmatched rules"]
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
          [[c.path + (f" (= {', '.join(c.aliases)})" if c.aliases else ""),
            f"{c.old_type} -> {c.new_type}", c.shape, c.recipe,
            _rule_str(c.rule, self.operation)] for c in self.converted])
    table("kept wide", ["path", "layer", "rule"],
          [[k.path, k.layer_type,
            "no rule matched, no default recipe" if k.rule is None
            else _rule_str(k.rule, self.operation)
            + (f": {k.why}" if k.why else "")] for k in self.kept_wide])
    table("skipped", ["path", "layer", "reason"],
          [[s.path or "(model)", s.layer_type, s.reason] for s in self.skipped])
    table("left as they were", ["path", "layer", "reason"],
          [[s.path, s.layer_type, s.reason] for s in self.already_quantized])
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


# ----------------------------------------------------------------------------
# Walking the model


_STOCK = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
_QUANT_OF = {nnx.Linear: QuantDense, nnx.LinearGeneral: QuantLinearGeneral,
             nnx.Einsum: QuantEinsum, nnx.Embed: QuantEmbed}
_STOCK_OF = {q: s for s, q in _QUANT_OF.items()}
_QUANT_ATTRS = ("quant",)


@dataclasses.dataclass
class _Site:
  path: str
  layer: nnx.Module
  refs: list  # (parent, key, path string) of every reference to the layer


def _path_str(path) -> str:
  return "/".join(str(p) for p in path)


def _is_quantized(m) -> bool:
  return isinstance(m, QuantLayer)


def _sites(model: nnx.Module, want) -> list[_Site]:
  """Every module ``want`` accepts, with all the places that reference it."""
  sites: dict[int, _Site] = {}
  nodes = list(nnx.iter_graph(model))
  for path, node in nodes:
    if isinstance(node, nnx.Module) and want(node) and path:
      sites.setdefault(id(node), _Site(_path_str(path), node, []))
  for path, node in nodes:
    if not graphlib.is_node(node):
      continue
    for key, child in graphlib.get_node_impl(node).node_dict(node).items():
      if id(child) in sites and sites[id(child)].layer is child:
        sites[id(child)].refs.append((node, key, _path_str(path + (key,))))
  return sorted(sites.values(), key=lambda s: s.path)


def _immutable_ref(site: _Site) -> str | None:
  for parent, _, path in site.refs:
    if graphlib.get_node_impl(parent).set_key is None:
      return (f"referenced at {path} from an immutable "
              f"{type(parent).__name__}; hold it in a list or nnx.List")
  return None


def _replace(site: _Site, new: nnx.Module) -> None:
  for parent, key, _ in site.refs:
    graphlib.get_node_impl(parent).set_key(parent, key, new)


def _adopt(new: nnx.Module, old: nnx.Module, skip=()) -> nnx.Module:
  """Gives ``new`` the attributes (and so the Variables) of ``old``."""
  data = getattr(old, "_pytree__nodes", {})
  for name, value in vars(old).items():
    if name.startswith("_pytree__") or name in skip:
      continue
    setattr(new, name, nnx.data(value) if data.get(name, False) else value)
  return new


# ----------------------------------------------------------------------------
# Per layer type: is it one GEMM, its (K, N), and a cheap twin to adopt into


class _Skip(Exception):
  pass


def _dims(layer) -> tuple[int, int]:
  """``(K, N)`` of the GEMM a (stock or quantized) layer runs."""
  if isinstance(layer, nnx.Embed):  # its attend: query @ embedding.T
    return layer.features, layer.num_embeddings
  if isinstance(layer, nnx.Linear):
    return layer.in_features, layer.out_features
  if isinstance(layer, nnx.LinearGeneral):
    return math.prod(layer.in_features), math.prod(layer.out_features)
  try:
    _, rhs, _, contracted, free = einsum_gemm_plan(layer.einsum_str)
  except ValueError:
    return 0, 0
  size = dict(zip(rhs, layer.kernel_shape))
  return (math.prod(size[c] for c in contracted),
          math.prod(size[c] for c in free))


def _one_gemm(layer) -> int:
  """Raises _Skip unless ``layer`` is one plain GEMM; returns kernel rank."""
  injected = "a custom {} is injected; replacing the layer would drop it"
  if isinstance(layer, nnx.Embed):
    return 2
  if isinstance(layer, nnx.Linear):
    if layer.dot_general is not jax.lax.dot_general:
      raise _Skip(injected.format("dot_general"))
    return 2
  if isinstance(layer, nnx.LinearGeneral):
    if layer.batch_axis:
      raise _Skip(f"batch_axis={dict(layer.batch_axis)} makes it a batched "
                  "GEMM (one weight per batch entry)")
    if layer.dot_general is not None or layer.dot_general_cls is not None:
      raise _Skip(injected.format("dot_general"))
    return len(layer.in_features) + len(layer.out_features)
  if layer.einsum_op is not jnp.einsum:
    raise _Skip(injected.format("einsum_op"))
  try:
    _, rhs, *_ = einsum_gemm_plan(layer.einsum_str)
  except ValueError as e:
    raise _Skip(str(e)) from None
  return len(rhs)


def _zero_init(key, shape, dtype):
  del key
  return np.zeros(shape, dtype)


def _twin(cls, layer, **quant) -> nnx.Module:
  """``cls`` built with size-1 features and ``layer``'s structure.

  Its throwaway Params are size-1 NumPy zeros (no random initialisation to
  run or compile); `_adopt` then replaces them with ``layer``'s Variables.
  """
  if issubclass(cls, nnx.Embed):
    return cls(1, 1, embedding_init=_zero_init, rngs=nnx.Rngs(0), **quant)
  kw = dict(kernel_init=_zero_init, bias_init=_zero_init,
            rngs=nnx.Rngs(0), **quant)
  if issubclass(cls, nnx.Linear):
    return cls(1, 1, use_bias=layer.use_bias, **kw)
  if issubclass(cls, nnx.LinearGeneral):
    return cls((1,) * len(layer.in_features), (1,) * len(layer.out_features),
               axis=layer.axis, use_bias=layer.use_bias, **kw)
  bias = None if layer.bias_shape is None else (1,) * len(layer.bias_shape)
  return cls(layer.einsum_str, (1,) * len(layer.kernel_shape), bias, **kw)


def _min_block(recipe: Recipe) -> tuple[int, str]:
  """Largest scaling block along K or N of the Fprop/Dgrad operands."""
  best = (1, "")
  for gemm in (recipe.fprop, recipe.dgrad):
    for spec in (gemm.lhs, gemm.rhs):
      if spec is not None and spec.granularity in ("tile", "block", "mx"):
        best = max(best, (spec.block_size, spec.granularity))
  return best


def _check(layer, recipe: Recipe) -> tuple[int, int]:
  """``(K, N)`` if ``layer`` can take ``recipe``, else raises _Skip."""
  if type(layer) not in _QUANT_OF:
    base = next(t for t in _QUANT_OF if isinstance(layer, t))
    raise _Skip(f"a subclass of nnx.{base.__name__}, whose behaviour the "
                "drop-in would not keep")
  rank = _one_gemm(layer)
  k, n = _dims(layer)
  block, gran = _min_block(recipe)
  if min(k, n) < block:
    raise _Skip(f"K={k}, N={n}: smaller than one {block}-element {gran} "
                f"scaling block of recipe {recipe.name!r} (mostly padding; "
                "block-scaled GEMM kernels reject it)")
  return k, n


def _weight(layer) -> nnx.Variable:
  return layer.embedding if isinstance(layer, nnx.Embed) else layer.kernel


# ----------------------------------------------------------------------------
# What the model is made of: its output head, and matmuls we cannot convert


def _in_definition_order(model) -> list:
  """Modules of ``model`` depth first, in the order their attributes were
  set (``__init__`` order, which for most models is the forward order)."""
  out, seen = [], set()

  def visit(node):
    if id(node) in seen:
      return
    seen.add(id(node))
    if isinstance(node, nnx.Module):
      out.append(node)
    if isinstance(node, (list, tuple)):
      children = list(node)
    elif isinstance(node, dict):
      children = list(node.values())
    elif isinstance(node, nnx.Module) or graphlib.is_node(node):
      items = (vars(node).items() if hasattr(node, "__dict__")
               else graphlib.get_node_impl(node).node_dict(node).items())
      children = [v for k, v in items if not str(k).startswith("_pytree__")]
    else:
      return
    for child in children:
      if isinstance(child, (nnx.Module, list, tuple, dict)) or (
          graphlib.is_node(child) and not isinstance(child, nnx.Variable)):
        visit(child)

  visit(model)
  return out


def _output_heads(model, linears: list) -> dict[int, str]:
  """``{id(layer): why}`` for the model's output head (see `Rule.head`)."""
  linears = [l for l in linears if not isinstance(l, nnx.Embed)]
  # A head's N feeds no other linear layer (a K of one would be a width).
  ks = {_dims(layer)[0] for layer in linears}
  vocab = {}
  for node in _in_definition_order(model):
    if isinstance(node, nnx.Embed) and node.num_embeddings not in ks:
      vocab.setdefault(node.num_embeddings, node)
  heads = {}
  for layer in linears:
    n = _dims(layer)[1]
    if n in vocab:
      heads[id(layer)] = (f"N={n} is the vocabulary of the embedding "
                          f"({vocab[n].num_embeddings} x {vocab[n].features})")
  if heads:
    return heads
  ids = {id(l) for l in linears}
  order = [m for m in _in_definition_order(model) if id(m) in ids]
  # A lone layer is not a model with a head.
  if len(order) > 1 and _dims(order[-1])[1] not in ks:
    n = _dims(order[-1])[1]
    heads[id(order[-1])] = (f"the last linear layer defined; its N={n} "
                            "features feed no other linear layer")
  return heads


# Params named like lookup tables (embeddings, positions), not matmul weights.
_TABLE_NAME = re.compile(r"emb|pos|wpe|wte|table|cache", re.IGNORECASE)


def _unrecognised(model, known: set[int]) -> list[Skipped]:
  """Modules that own a matmul weight (a Param of rank >= 2) but are not a
  layer `quantize` converts: listed so they are not passed over silently."""
  out = []
  for path, node in nnx.iter_graph(model):
    if (not isinstance(node, nnx.Module) or id(node) in known
        or isinstance(node, (QuantGemm, QuantLayer, nnx.Embed, *_STOCK))):
      continue
    weights = [(k, v) for k, v in vars(node).items()
               if isinstance(v, nnx.Param) and np.ndim(v.get_value()) >= 2
               and not _TABLE_NAME.search(k)]
    if not weights:
      continue
    name, var = weights[0]
    shape = tuple(np.shape(var.get_value()))
    if isinstance(node, nnx.Conv):
      why = ("not converted: a convolution (qlayers quantizes the GEMMs of "
             "nnx.Linear, nnx.LinearGeneral and nnx.Einsum)")
    else:
      why = (f"not converted: not a recognised linear layer (it owns the "
             f"Param {name!r} of shape {shape}); build it from nnx.Linear, "
             "or run its matmul through qlayers.QuantGemm, which takes "
             "lax.dot_general's arguments")
    out.append(Skipped(_path_str(path) or "(model)", type(node).__name__,
                       why))
  return out


# ----------------------------------------------------------------------------
# Public entry points


def _check_model(model) -> None:
  if not isinstance(model, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(model).__name__}.")


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


def quantize(model: nnx.Module, recipe: Recipe | str | None,
             rules: Rule | Iterable[Rule] | None = None, *,
             backend: str | None = None, strict: bool = False,
             inplace: bool = True) -> ConversionReport:
  """Swaps the linear layers of ``model`` for quantized drop-ins, in place.

  Each ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` (see the module
  docstring) is decided by the first rule that matches it (its pattern occurs
  in the module path; a ``head`` rule also needs the layer to be the output
  head): that rule's recipe, or kept wide for ``recipe=None``. Layers no rule
  matches get ``recipe`` (``None``: left as they are). An ``nnx.Embed``
  becomes a `qlayers.layers.QuantEmbed` (its ``attend``, a tied head,
  quantized) only when a rule with a recipe matches it. Modules that own a
  matmul weight but are none of these (``nnx.Conv``, a hand-written linear
  with a raw ``nnx.Param``) are listed in the report as not converted. A chosen layer is
  skipped, with the reason in the report, when it cannot take the recipe:
  its K or N is smaller than one scaling block of the recipe (tile/block:
  128, MX: 32; per-tensor and row-wise scaling take any size), it is not one GEMM (``batch_axis``, a batched einsum), it is a
  subclass of a stock layer, it has an injected ``dot_general`` /
  ``einsum_op``, or it sits in a tuple. Layers already quantized are left
  alone. A layer shared by several parents is swapped everywhere.

  Args:
    model: the model (an ``nnx.Module``).
    recipe: the recipe of layers no rule decides (name, path, `Recipe`), or
      ``None``.
    rules: `Rule` objects, first match wins. ``None`` uses `DEFAULT_RULES`,
      which keeps embeddings and output heads wide, by name
      (`DEFAULT_KEEP_WIDE`) and by what they are (`KEEP_HEAD_WIDE`).
      Explicit rules replace the defaults: append
      ``*qlayers.convert.DEFAULT_RULES`` to keep them.
    backend: GEMM backend for layers no rule gives one.
    strict: raise ValueError, before changing anything, if a rule decides no
      layer (the built-in `DEFAULT_RULES` are exempt).
    inplace: convert ``model`` itself (default) or a copy (``nnx.clone``,
      which has its own Params); the report's ``model`` is the result.

  Returns:
    A `ConversionReport`.

  Example:
    >>> from flax import nnx
    >>> import qlayers
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.up = nnx.Linear(64, 128, rngs=rngs)
    ...     self.head = nnx.Linear(128, 10, rngs=rngs)
    >>> net = Net(nnx.Rngs(0))
    >>> report = qlayers.quantize(net, "fp8_delayed")
    >>> type(net.up).__name__, type(net.head).__name__
    ('QuantDense', 'Linear')
    >>> [c.path for c in report.converted], [k.path for k in report.kept_wide]
    (['up'], ['head'])
  """
  _check_model(model)
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
  _root(model, report, lambda m: isinstance(m, _STOCK) or _is_quantized(m))
  used: set[int] = set()
  plan = []
  sites = _sites(model, lambda m: isinstance(m, (*_STOCK, nnx.Embed))
                 or _is_quantized(m))
  heads = _output_heads(model, [s.layer for s in sites])
  for site in sites:
    layer, kind = site.layer, type(site.layer).__name__
    head = heads.get(id(layer))
    rule = next((r for r in rules if r.matches(site.path, head)), None)
    if rule is not None:
      used.add(id(rule))
    if _is_quantized(layer):
      report.already_quantized.append(Skipped(
          site.path, kind, f"already quantized ({layer.recipe.name})"))
      continue
    if isinstance(layer, nnx.Embed) and (rule is None or rule.recipe is None):
      continue  # an embedding is only converted when a rule asks for it
    r = resolved[id(rule)] if rule is not None else default
    if r is None:
      report.kept_wide.append(KeptWide(
          site.path, kind, None if rule is None else _rule_name(rule),
          head if rule is not None and rule.head else ""))
      continue
    try:
      shape = _check(layer, r)
      why = _immutable_ref(site)
      if why:
        raise _Skip(why)
    except _Skip as e:
      report.skipped.append(Skipped(site.path, kind, str(e)))
      continue
    b = rule.backend if rule is not None and rule.backend else backend
    plan.append((site, r, b, shape, rule))
  # The built-in rules are a safety net, not something the user asked for:
  # a model without an embedding or head must not read as a rule mistake.
  report.unmatched_rules = [r for r in rules if id(r) not in used
                            and r not in DEFAULT_RULES]
  if strict:
    bad = report.unmatched_rules
    if bad:
      raise ValueError(
          "qlayers.quantize(strict=True): these rules decide no layer: "
          + "; ".join(f"{_rule_name(r)!r} -> {_recipe_name(r.recipe)}"
                      for r in bad)
          + ". Nothing was changed. Layer paths: "
          + ", ".join(s.path for s in _sites(model, lambda m: isinstance(
              m, _STOCK))) + ".")
  for site, r, b, shape, rule in plan:
    layer = site.layer
    cls = _QUANT_OF[type(layer)]
    new = _adopt(_twin(cls, layer, recipe=r, backend=b), layer)
    weight = _weight(layer)
    stack = tuple(weight.shape[:weight.ndim - _one_gemm(layer)])
    if stack and r.delayed:
      # Made under nnx.vmap: one delayed-scaling state per stacked layer.
      new.quant = QuantGemm(r, backend=b, batch_shape=stack)
    _replace(site, new)
    report.converted.append(Converted(
        site.path, type(layer).__name__, cls.__name__, shape, r.name,
        None if rule is None else _rule_name(rule),
        tuple(p for _, _, p in site.refs if p != site.path)))
  report.skipped.extend(_unrecognised(model, {id(s.layer) for s in sites}))
  return report


def dequantize_model(model: nnx.Module, *,
                     inplace: bool = True) -> ConversionReport:
  """Swaps `QuantDense` / `QuantLinearGeneral` / `QuantEinsum` back to stock.

  The inverse of `quantize`: each becomes ``nnx.Linear`` /
  ``nnx.LinearGeneral`` / ``nnx.Einsum`` with the same Params (the same
  Variable objects) and hyperparameters; its recipe, backend and
  quantization state are dropped. Other quantized layers are left as they
  are (reported).

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
  _check_model(model)
  if not inplace:
    model = nnx.clone(model)
  report = ConversionReport("qlayers.dequantize_model", model=model)
  _root(model, report, _is_quantized)
  plan = []
  for site in _sites(model, _is_quantized):
    layer, kind = site.layer, type(site.layer).__name__
    if type(layer) not in _STOCK_OF:
      report.already_quantized.append(Skipped(
          site.path, kind, "no stock layer to return to"))
      continue
    why = _immutable_ref(site)
    if why:
      report.skipped.append(Skipped(site.path, kind, why))
      continue
    plan.append(site)
  for site in plan:
    layer = site.layer
    cls = _STOCK_OF[type(layer)]
    new = _adopt(_twin(cls, layer), layer, skip=_QUANT_ATTRS)
    _replace(site, new)
    report.converted.append(Converted(
        site.path, type(layer).__name__, cls.__name__, _dims(layer),
        layer.recipe.name, None,
        tuple(p for _, _, p in site.refs if p != site.path)))
  return report
