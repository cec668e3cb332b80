"""Rules from measurements: the gradient-noise fallback, and rules files.

* `noise_fallback` keeps a layer wide when the quantization noise of its
  weight gradient exceeds a stated fraction of the gradient's norm, as
  measured by `qlayers.inspect.collect`. "FP4 All the Way" (Chmiel et al.,
  arXiv 2505.19115) finds that quantized training stops making progress
  once the gradient norm falls below about sqrt(3) times the quantization
  noise, i.e. noise / norm above 1/sqrt(3) (`SQRT3_RULE`, the default);
  the paper switches the whole model to higher precision then, this rule
  does it per layer. Opt-in: nothing applies it unless called.
* `save_rules` / `load_rules` write rules to JSON and read them back (also
  the proposals in a `Sensitivity.to_json` file), so a measuring step and a
  training step can run apart.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable, Sequence

from qlayers import convert
from qlayers.inspect import _tap
from qlayers.inspect.masked import GEMMS
from qlayers.inspect.report import Report, dump_json
from qlayers.inspect.sensitivity import _recipe_name, keep_wide_pattern

__all__ = ["SQRT3_RULE", "gradient_noise", "noise_fallback", "save_rules",
           "load_rules"]

SQRT3_RULE = 1.0 / math.sqrt(3.0)
"""noise / norm = 1/sqrt(3) ~ 0.577: the threshold of arXiv 2505.19115."""


def _reports(reports: Report | Iterable[Report]) -> list[Report]:
  out = [reports] if isinstance(reports, Report) else list(reports)
  if not out or not all(isinstance(r, Report) for r in out):
    raise TypeError("reports must be one or more qlayers.inspect.Report "
                    "(from qlayers.inspect.collect).")
  return out


def gradient_noise(reports: Report | Iterable[Report], *,
                   gemm: str = "wgrad") -> dict[str, float]:
  """``|noise| / |output|`` of each layer's ``gemm`` output, from its SQNR.

  ``10 ** (-sqnr_db / 20)``: for ``wgrad``, the norm of the quantization
  noise of the layer's weight gradient over the gradient's norm. Several
  reports (batches) combine as the root mean square of the ratios; a layer
  called several times keeps its largest.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0))
    >>> x = jnp.linspace(-1, 1, 8 * 64).reshape(8, 64)
    >>> rep = qlayers.inspect.collect(layer, lambda m, x: jnp.mean(m(x) ** 2), x)
    >>> 0 < qlayers.inspect.gradient_noise(rep)["(model)"] < 1
    True
  """
  if gemm not in GEMMS:
    raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}.")
  reports = _reports(reports)
  power: dict[str, list[float]] = {}
  for rep in reports:
    worst: dict[str, float] = {}
    for o in rep.outputs:
      if o.gemm == gemm:
        ratio = 10.0 ** (-o.sqnr_db / 20.0) if not math.isnan(o.sqnr_db) \
            else math.inf
        worst[o.path] = max(worst.get(o.path, 0.0), ratio)
    for path, ratio in worst.items():
      power.setdefault(path, []).append(ratio ** 2)
  if not power:
    raise ValueError(f"No layer has a {gemm!r} output in the reports (the "
                     "loss did not reach a quantized layer, no layer was "
                     "quantized, or, for wgrad, every quantized layer's "
                     "kernel is frozen: no weight gradient).")
  return {p: math.sqrt(sum(v) / len(v)) for p, v in power.items()}


def noise_fallback(reports: Report | Iterable[Report],
                   threshold: float = SQRT3_RULE, *,
                   rules: Iterable[convert.Rule] | None = None,
                   gemm: str = "wgrad") -> tuple[convert.Rule, ...]:
  """Rules keeping wide every layer whose gradient noise exceeds
  ``threshold`` times the gradient's norm (`gradient_noise` > threshold).

  Args:
    reports: `qlayers.inspect.collect` reports of the quantized model (a few
      batches; ideally late in training, where gradients are small).
    threshold: the stated fraction, > 0 (default `SQRT3_RULE`).
    rules: the rules the model is converted with (default
      `qlayers.convert.DEFAULT_RULES`); returned after the keep-wide rule.
    gemm: whose output noise counts (``wgrad``: the weight gradient).

  Returns:
    ``(Rule(pattern="^(a|b)$", recipe=None), *rules)``, or ``rules`` alone
    when no layer exceeds the threshold. Pass it to `qlayers.quantize`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0))
    >>> x = jnp.linspace(-1, 1, 8 * 64).reshape(8, 64)
    >>> rep = qlayers.inspect.collect(layer, lambda m, x: jnp.mean(m(x) ** 2), x)
    >>> len(qlayers.inspect.noise_fallback(rep, 1e-6, rules=()))  # wide
    1
    >>> qlayers.inspect.noise_fallback(rep, 0.99, rules=())  # quantized
    ()
  """
  if not (isinstance(threshold, (int, float)) and threshold > 0
          and math.isfinite(threshold)):
    raise ValueError(f"threshold must be a positive finite fraction of the "
                     f"gradient norm, got {threshold!r}.")
  rules = convert.DEFAULT_RULES if rules is None else tuple(rules)
  # Rules match layer paths (an expert's, an iteration's or one GEMM's row
  # is its layer's).
  noisy = list(dict.fromkeys(
      _tap.rule_path(p)
      for p, r in gradient_noise(reports, gemm=gemm).items() if r > threshold))
  if not noisy:
    return rules
  return (convert.Rule(pattern=keep_wide_pattern(noisy), recipe=None),
          *rules)


# ----------------------------------------------------------------------------
# Rules files


def _rule_dict(rule: convert.Rule) -> dict:
  return {"pattern": rule.pattern, "head": rule.head, "backend": rule.backend,
          "recipe": _recipe_name(rule.recipe)}


def save_rules(rules: Iterable[convert.Rule],
               path: str | pathlib.Path) -> pathlib.Path:
  """Writes ``rules`` as JSON (``{"rules": [...]}``; recipes by name or
  path: a `Recipe` its name does not load is a ValueError).

  Example:
    >>> import qlayers, tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "rules.json"
    >>> rules = (qlayers.Rule(pattern="^(a)$", recipe=None),)
    >>> _ = qlayers.inspect.save_rules(rules, p)
    >>> qlayers.inspect.load_rules(p) == rules
    True
  """
  path = pathlib.Path(path)
  dump_json({"rules": [_rule_dict(r) for r in rules]}, path)
  return path


def load_rules(path: str | pathlib.Path, *,
               k: int | None = None) -> tuple[convert.Rule, ...]:
  """Rules from a `save_rules` file, or from a `Sensitivity.to_json` file:
  its proposed rules, or (``k``) those of the proposal keeping ``k`` layers
  wide."""
  path = pathlib.Path(path)
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"Rules file {path}: {type(e).__name__}: {e}") from None
  if not isinstance(data, dict):
    raise ValueError(f"Rules file {path}: not a JSON object.")
  if "proposals" in data:  # a Sensitivity
    if k is None:
      entry = data.get("proposed")
      if entry is None:
        raise ValueError(f"Rules file {path}: the sensitivity has no "
                         "proposal; pass k.")
    else:
      found = [p for p in data["proposals"] if len(p["wide"]) == k]
      if not found:
        raise ValueError(f"Rules file {path}: no proposal keeps {k} layers "
                         f"wide; measured: "
                         f"{[len(p['wide']) for p in data['proposals']]}.")
      entry = found[0]
    items = entry["rules"]
  elif "rules" in data:
    if k is not None:
      raise ValueError(f"Rules file {path} holds one rule set; k applies to "
                       "sensitivity files only.")
    items = data["rules"]
  else:
    raise ValueError(f"Rules file {path} has neither 'rules' (save_rules) "
                     "nor 'proposals' (Sensitivity.to_json).")
  return tuple(_rule(item, path) for item in _list(items, path))


def _list(items, path) -> Sequence[dict]:
  if not isinstance(items, list) or not all(isinstance(i, dict)
                                            for i in items):
    raise ValueError(f"Rules file {path}: 'rules' must be a list of objects.")
  return items


def _rule(item: dict, path) -> convert.Rule:
  unknown = sorted(set(item) - {"pattern", "head", "backend", "recipe"})
  if unknown or "recipe" not in item:
    raise ValueError(f"Rules file {path}: a rule needs 'recipe' and may "
                     f"have 'pattern', 'head', 'backend'; got {sorted(item)}.")
  return convert.Rule(pattern=item.get("pattern", ""), recipe=item["recipe"],
                      backend=item.get("backend"),
                      head=bool(item.get("head", False)))
