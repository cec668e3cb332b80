"""What ``train_lm.py --keep-wide`` keeps wide, and measuring it in place.

The flag takes one of:

* ``REGEX``: module paths (``re.search``) kept wide in every recipe run;
* ``@PATH``: the rules in a JSON file: `qlayers.inspect.save_rules`'s, or
  the proposal of a `Sensitivity.to_json` file (``inspect_numerics.py
  --sensitivity`` writes one);
* ``auto``: the rules `qlayers.inspect.sensitivity` proposes for each recipe,
  measured in the same invocation;
* ``noise=FRACTION``: `qlayers.inspect.noise_fallback` for each recipe: the
  layers whose weight-gradient quantization noise exceeds ``FRACTION`` of
  the gradient's norm (``noise`` alone: 1/sqrt(3)), measured in the same
  invocation.

The measured kinds first train the baseline model of ``calib_seed`` for
``calib_steps`` steps (the same step and schedule as a run's first steps),
then measure on the next ``calib_batches`` training batches (not the
validation set). The rules of each recipe are printed and recorded.
"""

from __future__ import annotations

import pathlib
import re
from typing import Callable, Iterator

from flax import nnx

import qlayers
from _common import lm

AUTO = "auto"
NOISE = "noise"


def kind(spec: str) -> str:
  """``auto``, ``noise``, ``file`` or ``regex``."""
  if spec == AUTO:
    return "auto"
  if spec == NOISE or spec.startswith(NOISE + "="):
    return "noise"
  return "file" if spec.startswith("@") else "regex"


def measured(spec: str | None) -> bool:
  """Whether ``spec`` needs a calibration model (``auto``, ``noise``)."""
  return bool(spec) and kind(spec) in ("auto", "noise")


def threshold(spec: str) -> float:
  """The fraction of ``noise=FRACTION`` (``noise``: 1/sqrt(3))."""
  _, sep, value = spec.partition("=")
  if not sep:
    return qlayers.inspect.SQRT3_RULE
  try:
    out = float(value)
  except ValueError:
    out = -1.0
  if not 0 < out < float("inf"):
    raise ValueError(f"--keep-wide {spec!r}: FRACTION must be a positive "
                     "number")
  return out


def check(spec: str) -> None:
  """ValueError naming what is wrong with ``spec``."""
  k = kind(spec)
  if k == "noise":
    threshold(spec)
  elif k == "file":
    qlayers.inspect.load_rules(spec[1:])
  elif k == "regex":
    try:
      re.compile(spec)
    except re.error as e:
      raise ValueError(f"--keep-wide {spec!r} is not a regular expression: "
                       f"{e}") from None


def fixed_rules(spec: str) -> tuple[qlayers.Rule, ...]:
  """The rules of a ``REGEX`` or ``@PATH`` spec."""
  if kind(spec) == "file":
    return qlayers.inspect.load_rules(spec[1:])
  return (qlayers.Rule(pattern=spec, recipe=None),
          *qlayers.convert.DEFAULT_RULES)


def loss_fn(model, inputs, targets):
  return lm.next_token_loss(model(inputs), targets)


def calibrate(model: nnx.Module, optimizer, stream: Iterator, steps: int,
              batches: int) -> list[tuple]:
  """Trains ``model`` for ``steps`` steps of ``stream``; returns the next
  ``batches`` batches of it (to measure on)."""
  for _ in range(steps):
    lm.train_step(model, optimizer, *next(stream))
  return [tuple(next(stream)) for _ in range(batches)]


def measure(spec: str, model: nnx.Module, batches: list[tuple],
            recipe: str, *, log: Callable[[str], None] = print
            ) -> tuple[qlayers.Rule, ...]:
  """The rules ``spec`` (``auto`` or ``noise[=F]``) gives for ``recipe`` on
  the trained baseline ``model`` (which does not change)."""
  if kind(spec) == "auto":
    res = qlayers.inspect.sensitivity(model, loss_fn, batches, recipe,
                                      gemms=False, grads=False)
    log(res.table())
    return res.rules()
  work = nnx.clone(model)
  qlayers.quantize(work, recipe)
  reports = [qlayers.inspect.collect(work, loss_fn, *b) for b in batches]
  noise = qlayers.inspect.gradient_noise(reports)
  limit = threshold(spec)
  log(f"{recipe}: Wgrad noise / norm per layer (wide above {limit:.4g}): "
      + ", ".join(f"{p} {v:.3f}" for p, v in noise.items()))
  return qlayers.inspect.noise_fallback(reports, limit)


def describe(rules) -> list[dict]:
  """``rules`` as JSON-ready dicts (for the results file)."""
  return [{"pattern": r.pattern, "head": r.head,
           "recipe": getattr(r.recipe, "name", r.recipe)} for r in rules]


def save(rules, path: str | pathlib.Path) -> pathlib.Path:
  return qlayers.inspect.save_rules(rules, path)
