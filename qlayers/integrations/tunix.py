"""Tunix models and trainers with qlayers' quantized GEMMs.

Tunix (``pip install 'qlayers[tunix]'``, google-tunix) writes its models in
NNX: the MLPs are ``nnx.Linear`` (which `qlayers.quantize` converts), the
attention projections and an untied ``lm_head`` are Tunix's own ``Einsum``
module (a Param ``w`` and ``jnp.einsum``), which it does not. Here:

* `quantize`: `qlayers.quantize` plus Tunix's ``Einsum`` layers, swapped
  for `QuantTunixEinsum` (same Param ``w``, so Tunix's checkpoint loaders
  and weight mappings still apply) by the same rules; one report. The
  MoE layer of Tunix's Qwen3-MoE (stacked expert Params used by its own
  code) becomes a `qlayers.integrations.tunix_moe.QuantTunixMoE` (same
  Params; its router kept wide).
* `add_lora`: LoRA adapters (``nnx.LoRAParam``) on those ``Einsum`` layers
  (the attention projections), beside the quantized base GEMM. Tunix's
  trainer sees the LoRAParams and trains only them.
* `PeftTrainer`: Tunix's ``PeftTrainer`` (LoRA and full-weight SFT) with
  the hook delayed scaling needs. Tunix's own step runs
  ``nnx.value_and_grad`` with the Params (or LoRAParams) only and
  ``nnx.Optimizer.update``: the gradient amax never leaves the backward
  pass and no step is ever ended, so the amax histories stay empty and
  every step scales from the running amax (the inputs' max since the first
  step, the current gradient's amax): current-style scaling, not delayed
  scaling, and ``model.eval()`` warns. Its train step also differentiates
  `qlayers.QuantGradState` and ends the step with `qlayers.update_scales`
  after the optimizer update; its eval step runs the model in eval mode
  (``use_running_average=True``: stored scales, nothing recorded).
  Stateless recipes (``fp8_current``, MX, blockwise) run the same as under
  Tunix's own trainer. With ``gradient_accumulation_steps`` every
  micro-batch is one delayed-scaling step.

The hook lives in the one method Tunix meant for it,
``create_train_step_fn`` (and ``create_eval_step_fn``); the rest of the
trainer (data, jit, checkpoints, metrics) is Tunix's. Tunix's checkpoints
of a full-weight run hold the whole model state (amax histories included,
restored exactly into a model quantized alike); in LoRA mode, the adapters
only (a restored run starts its histories afresh).
"""

from __future__ import annotations

import math
import string

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qlayers import convert, swap, swap_experts
from qlayers.heads import output_heads
from qlayers.integrations import tunix_moe
from qlayers.layers.core import (QuantGemm, QuantLayer, gemms, seed_rounding,
                                 update_scales)
from qlayers.layers.dense import check_real
from qlayers.layers.frozen import check_finite, settle_delayed
from qlayers.layers.general import _expand_ellipsis, einsum_gemm_plan
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.state import QuantGradState

try:
  from tunix.sft import peft_trainer as _peft
except ImportError:  # the extra is not installed
  _peft = None

__all__ = ["QuantTunixEinsum", "quantize", "add_lora", "merge_lora", "PeftTrainer",
           "is_tunix_einsum"]

INSTALL = "pip install 'qlayers[tunix]'"


def is_tunix_einsum(m) -> bool:
  """Whether ``m`` is one of Tunix's ``Einsum`` layers (each model family
  defines its own: a Param ``w`` applied with ``jnp.einsum(einsum_str,
  x, w)``)."""
  return (type(m).__name__ == "Einsum"
          and type(m).__module__.startswith("tunix.")
          and isinstance(getattr(m, "w", None), nnx.Param)
          and isinstance(getattr(m, "einsum_str", None), str))


class QuantTunixEinsum(QuantLayer, nnx.Module):
  """Tunix's ``Einsum`` layer with its GEMM (forward and backward) quantized.

  Holds what Tunix's does, under the same names: the Param ``w`` of
  ``shape``, ``einsum_str``, ``dtype`` (input and weight are cast to it, as
  Tunix's Qwen3 does; ``None``: no cast, as its Llama 3); plus ``quant``
  (its `qlayers.QuantGemm`) and, after `add_lora`, the adapters ``lora_a``
  (the contracted dims of ``w``, then the rank) and ``lora_b`` (the rank,
  then ``w``'s other dims), added as ``x @ a @ b`` in the output dtype (as
  ``nnx.LoRA``, no scaling factor). The equation must be one GEMM
  (`qlayers.layers.general.einsum_gemm_plan`).

  Args:
    einsum_str: ``"input,weight->output"``, e.g. ``"BTD,DNH->BTNH"``.
    shape: the shape of ``w``.
    rngs: initialises ``w`` (Glorot uniform, as Tunix).
    dtype, param_dtype: computation (``None``: the operands') and Param
      dtypes.
    sharding: the Param's sharding names (Tunix's ``sharding``).
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlayers.integrations import tunix as qtunix
    >>> q = qtunix.QuantTunixEinsum("BTD,DNH->BTNH", (64, 4, 16),
    ...                             recipe="fp8_current", rngs=nnx.Rngs(0))
    >>> q(jnp.ones((2, 3, 64))).shape
    (2, 3, 4, 16)
    >>> qtunix.add_lora(q, 8, rngs=nnx.Rngs(1))
    1
    >>> q.lora_a.shape, q.lora_b.shape
    ((64, 8), (8, 4, 16))
  """

  def __init__(self, einsum_str: str, shape, *, rngs: nnx.Rngs,
               dtype=jnp.float32, param_dtype=jnp.float32, sharding=None,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None):
    _, rhs, *_ = einsum_gemm_plan(einsum_str)
    shape = tuple(shape)
    if len(rhs) != len(shape):
      raise ValueError(f"Einsum {einsum_str!r} names {len(rhs)} weight dims "
                       f"but shape is {shape}.")
    meta = {} if sharding is None else {"out_sharding": sharding}
    self.w = nnx.Param(nnx.initializers.glorot_uniform()(
        rngs.params(), shape, param_dtype), **meta)
    self.einsum_str = einsum_str
    self.shape = shape
    self.dtype = dtype
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self.w[...])

  @classmethod
  def from_tunix(cls, layer, recipe: Recipe | str, *,
                 backend: str | None = None) -> "QuantTunixEinsum":
    """The drop-in for Tunix ``Einsum`` ``layer``, holding its very ``w``."""
    new = cls(layer.einsum_str, (1,) * layer.w.ndim, rngs=nnx.Rngs(0),
              dtype=getattr(layer, "dtype", None), recipe=recipe,
              backend=backend)
    new.w = layer.w
    new.shape = tuple(layer.w.shape)
    new.quant.seed_from(new.w[...])
    return new

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    """The shape of ``w`` (as ``nnx.Einsum`` names it)."""
    return self.shape

  def gemm_plan(self):
    """``(lhs, rhs, out, contracted, free)`` index lists of the equation."""
    return einsum_gemm_plan(self.einsum_str)

  def __call__(self, x: jax.Array) -> jax.Array:
    check_real(type(self).__name__, x)
    lhs, rhs, out, contracted, free = self.gemm_plan()
    lhs, out = _expand_ellipsis(self.einsum_str.replace(" ", ""), lhs, out,
                                x.ndim)
    if x.ndim != len(lhs):
      raise ValueError(f"{type(self).__name__} {self.einsum_str!r}: input of "
                       f"shape {x.shape} has not {len(lhs)} dims.")
    w = self.w[...]
    if self.dtype is not None:
      x, w = jnp.astype(x, self.dtype), jnp.astype(w, self.dtype)
    dims = ((tuple(lhs.index(c) for c in contracted),
             tuple(rhs.index(c) for c in contracted)), ((), ()))
    y = self.quant(x, w, dims, preferred_element_type=self.dtype)
    # dot_general orders the output as the input's free indices, then the
    # weight's; the equation may want them in another order.
    have = [c for c in lhs if c not in contracted] + free
    if have != out:
      y = jnp.transpose(y, [have.index(c) for c in out])
    if self.lora_a is not None:
      r = next(c for c in string.ascii_letters
               if c not in self.einsum_str and c not in lhs)
      eq = (f"{''.join(lhs)},{''.join(contracted)}{r},{r}{''.join(free)}"
            f"->{''.join(out)}")
      y = y + jnp.einsum(eq, x, jnp.astype(self.lora_a[...], y.dtype),
                         jnp.astype(self.lora_b[...], y.dtype)).astype(y.dtype)
    return y


def _sizes(layer: QuantTunixEinsum) -> tuple[list[int], list[int]]:
  _, rhs, _, contracted, free = layer.gemm_plan()
  size = dict(zip(rhs, layer.shape))
  return [size[c] for c in contracted], [size[c] for c in free]


def add_lora(model: nnx.Module, rank: int, *, rngs: nnx.Rngs,
             param_dtype=jnp.float32, filter: str | None = None) -> int:
  """Adds LoRA adapters to every `QuantTunixEinsum` of ``model``.

  ``lora_a`` (initialised He-uniform over the contracted dims) and
  ``lora_b`` (zeros, so the model's output is unchanged) are
  ``nnx.LoRAParam``: Tunix's ``PeftTrainer`` then trains only them.

  Args:
    model: a model converted by `quantize` (or one `QuantTunixEinsum`).
    rank: the adapters' rank.
    rngs: initialises ``lora_a``.
    param_dtype: the adapters' dtype.
    filter: a regular expression on the module path (``"attn/(q|v)_proj"``);
      ``None``: every one.

  Returns:
    The number of layers that got adapters (a layer that has one keeps
    it).

  Raises:
    ValueError: no `QuantTunixEinsum` (``filter`` matched none, or the
      model is not quantized yet).
  """
  if rank < 1:
    raise ValueError(f"LoRA rank must be >= 1, got {rank}.")
  layers = ([model] if isinstance(model, QuantTunixEinsum) else
            [s.layer for s in swap.sites(
                model, lambda m: isinstance(m, QuantTunixEinsum))
             if filter is None or convert.rule_for(
                 [convert.Rule(pattern=filter, recipe=None)], s.paths)])
  if not layers:
    raise ValueError(
        "qlayers.integrations.tunix.add_lora found no QuantTunixEinsum"
        + (f" whose path matches {filter!r}" if filter else "")
        + ": quantize the model first (qlayers.integrations.tunix.quantize).")
  layers = [layer for layer in layers if layer.lora_a is None]
  for layer in layers:
    k, n = _sizes(layer)
    init = nnx.initializers.he_uniform(in_axis=tuple(range(len(k))),
                                       out_axis=-1)
    layer.lora_a = nnx.LoRAParam(init(rngs.params(), (*k, rank), param_dtype))
    layer.lora_b = nnx.LoRAParam(jnp.zeros((rank, *n), param_dtype))
  return len(layers)


def _merged(layer: QuantTunixEinsum) -> jax.Array:
  """``w + lora_a @ lora_b`` in FP32, laid out as ``w`` (leading dims: a
  stack of layers made under ``nnx.vmap``)."""
  _, rhs, _, contracted, free = layer.gemm_plan()
  r = next(c for c in string.ascii_letters if c not in rhs)
  delta = jnp.einsum(f"...{''.join(contracted)}{r},...{r}{''.join(free)}"
                     f"->...{''.join(rhs)}",
                     layer.lora_a[...].astype(jnp.float32),
                     layer.lora_b[...].astype(jnp.float32))
  return layer.w[...].astype(jnp.float32) + delta


def merge_lora(model: nnx.Module) -> int:
  """Folds the adapters `add_lora` put on ``model``'s `QuantTunixEinsum`
  layers into their ``w`` (``w + lora_a @ lora_b`` in FP32, laid out as
  ``w``) and removes them, in place; returns how many.

  Example:
    >>> from flax import nnx
    >>> from qlayers.integrations import tunix as qtunix
    >>> q = qtunix.QuantTunixEinsum("BTD,DNH->BTNH", (64, 4, 16),
    ...                             recipe="fp8_current", rngs=nnx.Rngs(0))
    >>> qtunix.add_lora(q, 8, rngs=nnx.Rngs(1)), qtunix.merge_lora(q)
    (1, 1)
    >>> q.lora_a is None
    True
  """
  layers = ([model] if isinstance(model, QuantTunixEinsum) else
            [s.layer for s in swap.sites(
                model, lambda m: isinstance(m, QuantTunixEinsum))])
  layers = [layer for layer in layers if layer.lora_a is not None]
  # Checked before any is merged (nothing half-done), made again to merge.
  check_finite("qtunix.merge_lora", ((type(layer).__name__, _merged(layer))
                                     for layer in layers))
  for layer in layers:
    layer.w[...] = _merged(layer).astype(layer.w.dtype)
    settle_delayed(layer, layer.w)
    layer.lora_a = nnx.data(None)
    layer.lora_b = nnx.data(None)
  return len(layers)


def quantize(model: nnx.Module, recipe: Recipe | str | None, rules=None, *,
             backend: str | None = None,
             **kwargs) -> convert.ConversionReport:
  """`qlayers.quantize` for a Tunix model: its Tunix ``Einsum`` and
  ``MoELayer`` layers too.

  Each Tunix ``Einsum`` (``MoELayer``) is decided by the first of ``rules``
  whose pattern matches its path (default: `qlayers.convert.DEFAULT_RULES`,
  which keep an ``lm_head`` and embeddings wide by name; ``head`` rules,
  which need the head found by tracing, do not apply to them) or gets
  ``recipe``, and is swapped for a `QuantTunixEinsum` (a
  `qlayers.integrations.tunix_moe.QuantTunixMoE`: its three expert GEMMs
  quantized); then `qlayers.quantize` converts the rest (``nnx.Linear``
  MLPs) and keeps the router of the experts wide. One report lists both.

  Args:
    model, recipe, rules, backend: as `qlayers.quantize`.
    **kwargs: passed on to `qlayers.quantize` (``example_input``;
      ``strict`` checks the Tunix layers' paths too, before anything
      changes); ``inplace=False`` is not supported.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlayers.integrations import tunix as qtunix
    >>> net = nnx.Dict(up=nnx.Linear(32, 64, rngs=nnx.Rngs(0)))
    >>> print(qtunix.quantize(net, "fp8_current").converted[0].path)
    up
  """
  if not kwargs.get("inplace", True):
    raise ValueError("qlayers.integrations.tunix.quantize converts in place; "
                     "clone the model first (nnx.clone).")
  rules = convert.DEFAULT_RULES if rules is None else (
      (rules,) if isinstance(rules, convert.Rule) else tuple(rules))
  default = None if recipe is None else load_recipe(recipe)
  tunix_sites = swap.sites(model, lambda m: is_tunix_einsum(m)
                          or tunix_moe.is_tunix_moe(m))
  if kwargs.pop("strict", False):
    _check_strict(model, rules, tunix_sites, kwargs.get("example_input"))
  done, wide, skipped, made = [], [], [], []
  for site in tunix_sites:
    layer, kind = site.layer, type(site.layer).__name__
    moe = tunix_moe.is_tunix_moe(layer)
    new_cls = tunix_moe.QuantTunixMoE if moe else QuantTunixEinsum
    rule = convert.rule_for(rules, site.paths)
    r = default if rule is None else (
        None if rule.recipe is None else load_recipe(rule.recipe))
    name = None if rule is None else rule.pattern
    if r is None:
      wide.append(convert.KeptWide(site.path, kind, name,
                                   aliases=site.paths[1:]))
      continue
    try:
      shape = (tunix_moe.check if moe else _check)(layer, r)
    except swap.Skip as e:
      skipped.append(convert.Skipped(site.path, kind, str(e)))
      continue
    b = rule.backend if rule is not None and rule.backend else backend
    new = new_cls.from_tunix(layer, r, backend=b)
    swap.replace(site, new)
    made.extend(g for _, g in gemms(new))
    done.append(convert.Converted(
        site.path, kind, new_cls.__name__, shape, r.name, name,
        tuple(p for _, _, p in site.refs if p != site.path)))
  # Seeded from their paths, as `qlayers.quantize` seeds what it converts:
  # the drop-ins' own seeds are their size-1 twins' (all alike).
  seed_rounding(model, only=made)
  report = convert.quantize(model, recipe, rules, backend=backend, **kwargs)
  ours = {c.path for c in done} | {k.path for k in wide} | {
      s.path for s in skipped}
  report.already_quantized = [s for s in report.already_quantized
                              if s.path not in ours]
  report.skipped = [s for s in report.skipped if s.path not in ours]
  report.converted = sorted(done + report.converted, key=lambda c: c.path)
  report.kept_wide = sorted(wide + report.kept_wide, key=lambda k: k.path)
  report.skipped = sorted(skipped + report.skipped, key=lambda s: s.path)
  return report


def _check_strict(model, rules, tunix_sites, example_input) -> None:
  """`qlayers.quantize`'s ``strict`` check over the Tunix layers and the
  others, before anything changes: every rule but the default ones must be
  the first to match some layer (a ``head`` rule, its output head)."""
  sites = swap.sites(model, swap.is_gemm)
  heads = {}
  if example_input is not None or any(r.head for r in rules):
    heads, _ = output_heads(model, [s.layer for s in sites],
                            {id(s.layer): s.path for s in sites},
                            example_input)
  used = set()
  for site in tunix_sites + sites + swap_experts.sites(model):
    head = heads.get(id(site.layer), "")
    used.add(id(convert.rule_for(rules, site.paths, head)))
  bad = [r for r in rules if id(r) not in used
         and r not in convert.DEFAULT_RULES]
  if bad:
    raise convert.strict_error(bad, [p for s in tunix_sites + sites
                                     for p in s.paths])


def _check(layer, recipe: Recipe) -> tuple[int, int]:
  """``(K, N)`` of Tunix ``Einsum`` ``layer`` if it takes ``recipe``."""
  if getattr(layer, "w_scale", None) is not None:
    raise swap.Skip("its weight is scaled by a separate w_scale Param, which "
                    "the drop-in would drop")
  extra = sorted(k for k, v in vars(layer).items()
                 if isinstance(v, nnx.Variable) and k != "w")
  if extra:
    raise swap.Skip(f"it holds {', '.join(extra)} beside w (qwix LoRA?), "
                    "which the drop-in would drop: quantize first, then add "
                    "adapters with qlayers.integrations.tunix.add_lora")
  if hasattr(layer, "qwix_path"):
    raise swap.Skip("qwix has wrapped the model (its modules carry "
                    "qwix_path), and its interception would not reach the "
                    "drop-in: quantize before applying qwix")
  try:
    _, rhs, _, contracted, free = einsum_gemm_plan(layer.einsum_str)
  except ValueError as e:
    raise swap.Skip(str(e)) from None
  size = dict(zip(rhs, layer.w.shape))
  k = math.prod(size[c] for c in contracted)
  n = math.prod(size[c] for c in free)
  block, gran = swap.min_block(recipe)
  if min(k, n) < block:
    raise swap.Skip(f"K={k}, N={n}: smaller than one {block}-element {gran} "
                    f"scaling block of recipe {recipe.name!r}")
  return k, n


def _train_step(trainer, model, optimizer, inputs):
  """Tunix's train step, plus the gradient amax and the end of the step."""
  inputs = trainer.gen_model_input_fn(inputs)
  has_aux = trainer._has_aux  # pylint: disable=protected-access
  grad_fn = nnx.value_and_grad(
      trainer.loss_fn, argnums=nnx.DiffState(0, (optimizer.wrt,
                                                 QuantGradState)),
      has_aux=has_aux)
  out, grads = grad_fn(model, **inputs)
  amaxes, grads = nnx.split_state(grads, QuantGradState, ...)
  grad_norm = optax.tree.norm(grads)
  optimizer.update(model, grads)
  update_scales(model, amaxes)
  loss, aux = out if has_aux else (out, None)
  return loss, aux, grad_norm


def _eval_step(trainer, model, inputs):
  """Tunix's eval step with the quantized GEMMs in eval mode."""
  inputs = trainer.gen_model_input_fn(inputs)
  view = nnx.view(model, only=QuantGemm, raise_if_not_found=False,
                  use_running_average=True)
  out = trainer.eval_loss_fn(view, **inputs)
  has_aux = trainer._has_aux  # pylint: disable=protected-access
  return out if has_aux else (out, None)


if _peft is not None:

  class PeftTrainer(_peft.PeftTrainer):
    """Tunix's ``PeftTrainer`` whose steps keep delayed scaling exact.

    Same constructor and use as ``tunix.sft.peft_trainer.PeftTrainer``
    (LoRA when the model has ``nnx.LoRAParam``s, full-weight SFT
    otherwise); only ``create_train_step_fn`` and ``create_eval_step_fn``
    differ (see the module docstring). With a model without delayed
    recipes it trains exactly as Tunix's, except that its eval runs in
    eval mode: a step-keyed stochastic recipe (``nvfp4``) does not advance
    its rounding counters there.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import qlayers
      >>> from qlayers.integrations import tunix as qtunix
      >>> from tunix.sft import peft_trainer
      >>> model = qlayers.QuantDense(8, 8, recipe="fp8_delayed",
      ...                            rngs=nnx.Rngs(0))
      >>> trainer = qtunix.PeftTrainer(
      ...     model, optax.sgd(0.1),
      ...     peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=2,
      ...                                 pbar_description=None))
      >>> trainer = trainer.with_loss_fn(
      ...     lambda m, x: jnp.mean((m(x) - x) ** 2))
      >>> trainer.train([{"x": jnp.ones((4, 8))}] * 2)
      >>> bool(model.quant.g_amax_history[1] > 0)
      True
    """

    def create_train_step_fn(self):
      return lambda model, optimizer, inputs: _train_step(
          self, model, optimizer, inputs)

    def create_eval_step_fn(self):
      return lambda model, inputs: _eval_step(self, model, inputs)

else:

  class PeftTrainer:  # pylint: disable=too-few-public-methods
    """Tunix's ``PeftTrainer`` with delayed scaling (needs google-tunix)."""

    def __init__(self, *args, **kwargs):
      del args, kwargs
      raise ImportError(f"qlayers.integrations.tunix.PeftTrainer needs "
                        f"google-tunix: {INSTALL}.")
