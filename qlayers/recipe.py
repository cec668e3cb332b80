"""Recipes: which format and scaling each operand of each GEMM gets.

A linear layer runs three GEMMs per training step:

* Fprop ``y = x @ w`` (operands ``x`` and ``w``, contracted over K),
* Dgrad ``dx = g @ w.T`` (``g`` and ``w``, contracted over N),
* Wgrad ``dw = x.T @ g`` (``x`` and ``g``, contracted over the tokens M),

where ``g`` is the output gradient. A `Recipe` gives every operand of every
GEMM its own `QuantSpec` (or ``None`` for no quantization). Named recipes are
TOML files in ``recipes/``; ``qlayers.recipe("fp8_delayed")`` loads one, and
``qlayers.recipe("path/to/mine.toml")`` a file of your own.

A file quantizes the operands its ``[fprop]``, ``[dgrad]`` and ``[wgrad]``
tables list (``[defaults]`` fills in their fields). A wide recipe (no
quantized GEMM, as ``bf16.toml``) has none of these tables and no setting
that only quantization reads; a file with such settings that quantizes
nothing is refused, as are out-of-range sizes (see `validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import pathlib
import tomllib
from typing import Any, Literal

import jax.numpy as jnp

from qlayers import formats
from qlayers import hadamard
from qlayers.scaling import QuantSpec, check_fields

__all__ = ["GemmRecipe", "Recipe", "recipe", "available_recipes", "validate"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}

# Transformer Engine's default history is 1024 steps (as fp8_delayed's);
# 4x that bounds the state (16 KiB a role) and the per-step history max,
# which reads the whole history of every role of every GEMM.
MAX_AMAX_HISTORY_LEN = 4096
# Top-level settings read only by quantized GEMMs: a file that sets one (or
# has a [defaults] table) but quantizes nothing is refused.
_QUANT_ONLY_KEYS = ("defaults", "scaling", "amax_history_len",
                    "amax_compute_algo", "save_quantized_wgrad_input",
                    "sr_key")
# Top-level settings read only by delayed scaling.
_DELAYED_ONLY_KEYS = ("amax_history_len", "amax_compute_algo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmRecipe:
  """Operand specs of one GEMM (``None``: that operand stays wide).

  Attributes:
    lhs: spec of the left operand (x in Fprop/Wgrad, g in Dgrad).
    rhs: spec of the right operand (w in Fprop/Dgrad, g in Wgrad).
    out_dtype: stored output dtype; ``None`` means the layer's compute dtype
      for Fprop/Dgrad and FP32 for Wgrad. Fprop's is the layers' output
      dtype unless a layer (or call) is given ``preferred_element_type``.
    accum_dtype: accumulator dtype (FP32 is the only one supported).
    hadamard: block size of a random Hadamard transform applied to both
      operands along the contraction dim before they are quantized (0: none;
      the gradient GEMMs only, Dgrad over N and Wgrad over the tokens; see
      `qlayers.hadamard`). The product is unchanged in exact arithmetic;
      outliers spread over the block, which helps 4-bit elements.
  """

  lhs: QuantSpec | None = None
  rhs: QuantSpec | None = None
  out_dtype: str | None = None
  accum_dtype: str = "float32"
  hadamard: int = 0

  def __post_init__(self):
    check_fields(self)

  @property
  def quantized(self) -> bool:
    return self.lhs is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
  """A complete low-precision training recipe.

  Attributes:
    name: recipe name.
    description: one line on what it is for.
    fprop, dgrad, wgrad: the three GEMMs.
    scaling: ``current`` (amax of the tensor being cast) or ``delayed``
      (per-tensor scales from an amax history kept as layer state).
    amax_history_len: delayed scaling history length (TE default 1024;
      at most `MAX_AMAX_HISTORY_LEN`).
    amax_compute_algo: ``max`` or ``most_recent``.
    compute_dtype: dtype of unquantized GEMM inputs, and of the outputs of
      inputs narrower than 16 bits; other outputs keep the (promoted) input
      dtype, as nnx's layers do, unless ``fprop.out_dtype`` is set.
    save_quantized_wgrad_input: keep the Wgrad input ``x`` quantized (FP8)
      between forward and backward instead of in ``compute_dtype``.
    loss_scaling: ``none`` or ``dynamic`` (FP16 needs it).
    sr_key: where the stochastic-rounding key of a layer's GEMM comes
      from when none is passed: ``data`` (derived from the bits of the
      operand: the default, and what recipes before it did) or ``step``
      (a counter in the GEMM's state, `qlayers.QuantGemm`, advanced by each
      training call: the same bits however the operands are laid out or
      sharded). Only for recipes that round stochastically.

  Example:
    >>> import qlayers
    >>> r = qlayers.recipe("fp8_delayed")
    >>> r.fprop.lhs.format, r.dgrad.lhs.format
    ('e4m3', 'e5m2')
  """

  name: str = "custom"
  description: str = ""
  fprop: GemmRecipe = GemmRecipe()
  dgrad: GemmRecipe = GemmRecipe()
  wgrad: GemmRecipe = GemmRecipe()
  scaling: Literal["current", "delayed"] = "current"
  amax_history_len: int = 1024
  amax_compute_algo: Literal["max", "most_recent"] = "max"
  compute_dtype: str = "bfloat16"
  save_quantized_wgrad_input: bool = False
  loss_scaling: Literal["none", "dynamic"] = "none"
  sr_key: Literal["data", "step"] = "data"

  def __post_init__(self):
    validate(self)

  @property
  def quantized(self) -> bool:
    return any(g.quantized for g in (self.fprop, self.dgrad, self.wgrad))

  @property
  def delayed(self) -> bool:
    return self.scaling == "delayed" and self.quantized

  @property
  def dtype(self):
    return _DTYPES[self.compute_dtype]

  @property
  def stochastic(self) -> bool:
    return any(s is not None and s.stochastic for s in self.specs().values())

  def specs(self) -> dict[str, QuantSpec | None]:
    """Operand specs keyed ``fprop.x``, ``fprop.w``, ``dgrad.g``, ..."""
    return {"fprop.x": self.fprop.lhs, "fprop.w": self.fprop.rhs,
            "dgrad.g": self.dgrad.lhs, "dgrad.w": self.dgrad.rhs,
            "wgrad.x": self.wgrad.lhs, "wgrad.g": self.wgrad.rhs}

  def replace(self, **changes) -> "Recipe":
    """A copy with ``changes`` applied (and validated)."""
    return dataclasses.replace(self, **changes)


def validate(r: Recipe) -> None:
  """Raises ValueError with an actionable message if ``r`` is inconsistent
  or out of range (``amax_history_len`` up to `MAX_AMAX_HISTORY_LEN`,
  tile/block lengths in `scaling.BLOCK_SIZES`, checked by `QuantSpec`); TypeError for a field of the wrong
  type (see `scaling.check_fields`)."""
  check_fields(r)
  where = f"recipe {r.name!r}"
  if r.scaling not in ("current", "delayed"):
    raise ValueError(f"{where}: scaling must be 'current' or 'delayed', got "
                     f"{r.scaling!r}.")
  if r.amax_compute_algo not in ("max", "most_recent"):
    raise ValueError(f"{where}: amax_compute_algo must be 'max' or "
                     f"'most_recent', got {r.amax_compute_algo!r}.")
  if not 1 <= r.amax_history_len <= MAX_AMAX_HISTORY_LEN:
    raise ValueError(f"{where}: amax_history_len must be >= 1 and <= "
                     f"{MAX_AMAX_HISTORY_LEN} (Transformer Engine's default "
                     f"is 1024), got {r.amax_history_len}.")
  if r.compute_dtype not in _DTYPES:
    raise ValueError(f"{where}: compute_dtype must be one of "
                     f"{sorted(_DTYPES)}, got {r.compute_dtype!r}.")
  if r.loss_scaling not in ("none", "dynamic"):
    raise ValueError(f"{where}: loss_scaling must be 'none' or 'dynamic'.")
  for gname in ("fprop", "dgrad", "wgrad"):
    g = getattr(r, gname)
    if (g.lhs is None) != (g.rhs is None):
      raise ValueError(
          f"{where}: {gname} quantizes one operand only; quantize both "
          "operands of a GEMM or neither.")
    if g.accum_dtype != "float32":
      raise ValueError(f"{where}: {gname}.accum_dtype must be float32 "
                       f"(got {g.accum_dtype!r}).")
    if g.out_dtype is not None and g.out_dtype not in _DTYPES:
      raise ValueError(f"{where}: {gname}.out_dtype must be one of "
                       f"{sorted(_DTYPES)} or unset.")
    if g.hadamard:
      if gname == "fprop":
        raise ValueError(
            f"{where}: fprop.hadamard is not supported; the Hadamard "
            "transform applies to the gradient GEMMs (dgrad, wgrad) only.")
      if g.hadamard not in hadamard.SIZES:
        raise ValueError(f"{where}: {gname}.hadamard must be 0 or one of "
                         f"{hadamard.SIZES}, got {g.hadamard!r}.")
      if not g.quantized:
        raise ValueError(f"{where}: {gname}.hadamard needs quantized "
                         f"{gname} operands (it only changes what gets "
                         "quantized).")
      if r.scaling == "delayed":
        raise ValueError(
            f"{where}: {gname}.hadamard needs scaling='current': delayed "
            "scales come from the amax of the untransformed tensors.")
    if g.quantized and g.lhs.format == "e5m2" and g.rhs.format == "e5m2":
      raise ValueError(
          f"{where}: {gname} would multiply E5M2 by E5M2, which loses too "
          "much precision; keep one operand E4M3 (HYBRID: E5M2 for "
          "gradients only).")
  if r.delayed:
    for role, spec in r.specs().items():
      if spec is not None and spec.granularity != "tensor":
        raise ValueError(
            f"{where}: delayed scaling keeps one scale per tensor, but "
            f"{role} uses granularity {spec.granularity!r}; use "
            "scaling='current' for row/tile/block/mx.")
  if r.sr_key == "step" and not r.stochastic:
    raise ValueError(f"{where}: sr_key='step' keys stochastic rounding, but "
                     "no operand rounds stochastically; set rounding = "
                     "\"stochastic\" on one, or drop sr_key.")
  if r.compute_dtype == "float16" and r.loss_scaling != "dynamic":
    raise ValueError(f"{where}: float16 compute needs loss_scaling='dynamic' "
                     "(gradients underflow otherwise).")


# ----------------------------------------------------------------------------
# Loading


def _recipes_dirs() -> list[pathlib.Path]:
  """Where the named recipes are: installed with the package, or the
  checkout's ``recipes/`` (an editable install). Recipes of your own are
  loaded by path: ``qlayers.recipe("path/to/mine.toml")``."""
  pkg = pathlib.Path(str(importlib.resources.files("qlayers"))) / "recipes"
  here = pathlib.Path(__file__).resolve().parent.parent / "recipes"
  return [d for d in (pkg, here) if d.is_dir()]


def available_recipes() -> list[str]:
  """Names of the recipes shipped with qlayers."""
  names = set()
  for d in _recipes_dirs():
    names.update(p.stem for p in d.glob("*.toml"))
  return sorted(names)


_GEMM_ROLES = {"fprop": ("x", "w"), "dgrad": ("g", "w"), "wgrad": ("x", "g")}


def _table(value: Any, where: str, example: str) -> dict:
  """``value`` if it is a TOML table, else a ValueError naming ``where``."""
  if not isinstance(value, dict):
    raise ValueError(f"{where} must be a table ({example}), got {value!r} "
                     f"({type(value).__name__}).")
  return value


def _spec_fields(table: dict, where: str) -> None:
  """Refuses keys that are not `QuantSpec` fields."""
  known = {f.name for f in dataclasses.fields(QuantSpec)}
  unknown = set(table) - known
  if unknown:
    raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: "
                     f"{sorted(known)}.")


def _check_defaults(defaults: dict, where: str) -> None:
  """Type-checks ``[defaults]`` on its own, so a bad value is refused even
  where every operand overrides it. Only the field types are checked here
  (a default such as ``format = "e2m1"`` may need the operands' own
  ``granularity``); each merged operand is then a full `QuantSpec`."""
  _spec_fields(defaults, where)
  probe = object.__new__(QuantSpec)  # fields only: no __post_init__ rules
  for f in dataclasses.fields(QuantSpec):
    object.__setattr__(probe, f.name, defaults.get(f.name, f.default))
  try:
    check_fields(probe)
    formats.get_format(probe.format)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None


def _spec(table: dict, where: str) -> QuantSpec:
  _spec_fields(table, where)
  try:
    return QuantSpec(**table)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None


def from_dict(data: dict, source: str = "<dict>") -> Recipe:
  """Builds a `Recipe` from the TOML-shaped dict ``data`` (``source``, the
  file, starts every error message)."""
  data = dict(data)
  quant_only = ["[defaults]" if k == "defaults" else k
                for k in _QUANT_ONLY_KEYS if k in data]
  defaults = _table(data.pop("defaults", {}), f"{source}: [defaults]",
                    'e.g. format = "e4m3"')
  _check_defaults(defaults, f"{source}: [defaults]")
  kwargs = {}
  for gname, (lrole, rrole) in _GEMM_ROLES.items():
    table = dict(_table(data.pop(gname, {}), f"{source}: [{gname}]",
                        f"of operands {lrole!r} and {rrole!r}"))
    out_dtype = table.pop("out_dtype", None)
    accum = table.pop("accum_dtype", "float32")
    rht = table.pop("hadamard", 0)
    unknown = set(table) - {lrole, rrole}
    if unknown:
      raise ValueError(f"{source}: [{gname}] takes operands {lrole!r} and "
                       f"{rrole!r}, not {sorted(unknown)}.")

    def merged(role, gname=gname, table=table):
      if role not in table:
        return None
      where = f"{source}: {gname}.{role}"
      t = _table(table[role], where, '{ format = "e4m3" }, or {} for '
                 "the [defaults]")
      spec = {**defaults, **t}
      if ("granularity" in t and "block_size" not in t
          and "block_size" in defaults
          and t["granularity"] != defaults.get("granularity")):
        del spec["block_size"]  # the [defaults]' blocks are not this one's
      return _spec(spec, where)

    lhs, rhs = merged(lrole), merged(rrole)
    try:
      kwargs[gname] = GemmRecipe(lhs=lhs, rhs=rhs, out_dtype=out_dtype,
                                 accum_dtype=accum, hadamard=rht)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{source}: [{gname}] {e}") from None
  known = {f.name for f in dataclasses.fields(Recipe)}
  unknown = set(data) - known
  if unknown:
    raise ValueError(f"{source}: unknown recipe keys {sorted(unknown)}.")
  try:
    r = Recipe(**data, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{source}: {e}") from None
  keys = list(data) + ["[defaults]"] * ("[defaults]" in quant_only)
  _check_settings(r, keys, source)
  return r


def _check_settings(r: Recipe, keys, source: str) -> None:
  """Refuses settings ``keys`` (given in a file or as overrides) that
  ``r`` would never read."""
  delayed_only = [k for k in _DELAYED_ONLY_KEYS if k in keys]
  if delayed_only and r.quantized and not r.delayed:
    raise ValueError(
        f"{source}: sets {', '.join(delayed_only)}, which only delayed "
        f"scaling reads, but scaling is {r.scaling!r}: drop them, or set "
        'scaling = "delayed".')
  if ("save_quantized_wgrad_input" in keys and r.save_quantized_wgrad_input
      and r.quantized and r.wgrad.lhs is None):
    raise ValueError(
        f"{source}: sets save_quantized_wgrad_input, but Wgrad's x is not "
        "quantized, so there is no quantized copy to save: drop it, or "
        "quantize [wgrad] x.")
  quant_only = [k for k in keys if k in _QUANT_ONLY_KEYS or k == "[defaults]"]
  if quant_only and not r.quantized:
    raise ValueError(
        f"{source}: sets {', '.join(quant_only)} but quantizes no GEMM: "
        "list the operands to quantize in [fprop], [dgrad] and [wgrad] "
        "(e.g. [fprop] x = {} w = {}; [defaults] only fills in their "
        "fields), or, for a wide recipe, drop these settings (as bf16.toml "
        "has none).")


def recipe(name_or_path: "str | os.PathLike | Recipe", **changes) -> Recipe:
  """Loads a recipe by name (``"fp8_delayed"``) or from a TOML file path.

  Keyword ``changes`` override top-level fields, e.g.
  ``recipe("fp8_delayed", amax_history_len=16)``; as in a file, a setting
  the recipe would not read (``amax_history_len`` of a current-scaling
  recipe, ``scaling`` of one that quantizes nothing) is refused.
  """
  if isinstance(name_or_path, Recipe):
    return _changed(name_or_path, changes)
  text = str(name_or_path)
  path = pathlib.Path(text)
  # A shipped recipe's name wins over a same-named file in the working
  # directory; a path (a PathLike, a folder in it, or .toml) is a file.
  named = not (isinstance(name_or_path, os.PathLike) or text.endswith(".toml")
               or os.sep in text or (os.altsep or os.sep) in text)
  shipped = [d / f"{text}.toml" for d in _recipes_dirs()] if named else []
  shipped = [f for f in shipped if f.is_file()]
  if shipped:
    path = shipped[0]
  elif named and not path.is_file():
    names = available_recipes()
    close = difflib.get_close_matches(text, names, n=3, cutoff=0.5)
    hint = f" did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"Unknown recipe {text!r};{hint} available: {names} "
                     "(or pass a .toml path).")
  if not path.is_file():
    raise FileNotFoundError(f"Recipe file {path} " + (
        "is not a file." if path.exists() else "does not exist."))
  try:
    data = tomllib.loads(path.read_bytes().decode("utf-8"))
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid TOML (TOML is UTF-8): {e}") from None
  except tomllib.TOMLDecodeError as e:
    raise ValueError(f"{path}: not valid TOML: {e}") from None
  data.setdefault("name", path.stem)
  return _changed(from_dict(data, str(path)), changes)


def _changed(r: Recipe, changes: dict) -> Recipe:
  """``r`` with the overrides ``changes``, refused where unread."""
  if not changes:
    return r
  out = r.replace(**changes)
  _check_settings(out, list(changes), f"recipe {r.name!r} with {changes}")
  return out
