"""qlayers.inspect.rules: the gradient-noise fallback honours its threshold;
rules files round-trip, and a sensitivity file gives its proposal."""

import dataclasses
import importlib
import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qlayers
# (the module: ``qlayers.inspect.sensitivity`` is the function)
S = importlib.import_module("qlayers.inspect.sensitivity")


class Two(nnx.Module):
  """``b(tanh(a(x)))`` of two plain linears (paths ``a`` and ``b``)."""

  def __init__(self, rngs):
    self.a = nnx.Linear(64, 64, use_bias=False, rngs=rngs)
    self.b = nnx.Linear(64, 64, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _loss(m, x):
  return jnp.mean(m(x).astype(jnp.float32) ** 2)


def _reports(n=2):
  model = Two(nnx.Rngs(0))
  qlayers.quantize(model, "mxfp4", rules=())
  return [qlayers.inspect.collect(model, _loss, jax.random.normal(
      jax.random.key(i), (16, 64))) for i in range(n)]


def test_noise_fallback_keeps_wide_exactly_the_layers_above_the_threshold():
  reps = _reports()
  noise = qlayers.inspect.gradient_noise(reps)
  # The ratio is the Wgrad output SQNR read as |noise| / |gradient|,
  # combined over the reports as a root mean square.
  for path in ("a", "b"):
    ratios = [10 ** (-r.output(path, "wgrad") / 20) for r in reps]
    assert noise[path] == pytest.approx(
        math.sqrt(sum(v * v for v in ratios) / 2), rel=1e-12)
  lo, hi = sorted(noise.values())
  assert 0 < lo < hi < 1, noise
  noisier = max(noise, key=noise.get)
  base = (qlayers.Rule(pattern="nothing", recipe=None),)
  fb = qlayers.inspect.noise_fallback
  # Between the two ratios: only the noisier layer stays wide.
  between = fb(reps, (lo + hi) / 2, rules=base)
  assert between == (qlayers.Rule(pattern=f"^({noisier})$", recipe=None),
                     *base)
  # Below both: both; above both: the rules unchanged.
  assert fb(reps, lo / 2, rules=base)[0].pattern == "^(a|b)$"
  assert fb(reps, hi * 1.01, rules=base) == base
  # The rules convert a fresh model as measured.
  report = qlayers.quantize(Two(nnx.Rngs(0)), "mxfp4", between[:1])
  assert [c.path for c in report.converted] == [
      {"a": "b", "b": "a"}[noisier]]


def test_noise_fallback_names_a_grouped_gemm_by_its_layer():
  """Each expert is measured as its own row (``moe[e]``); the rule keeping
  them wide names the layer, which quantize matches."""
  model = nnx.Dict(moe=qlayers.QuantExperts(2, 32, 16, recipe="mxfp4",
                                            rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(0), (6, 32))
  gs = jnp.array([2, 4])
  rep = qlayers.inspect.collect(model, lambda m, x: jnp.mean(m.moe(x, gs) ** 2),
                                x)
  assert {o.path for o in rep.outputs} == {"moe[0]", "moe[1]"}
  rule, = qlayers.inspect.noise_fallback(rep, 1e-9, rules=())
  assert rule.pattern == "^(moe)$" and rule.matches("moe")


def test_noise_fallback_default_threshold_and_errors():
  reps = _reports(1)
  # MXFP4 Wgrad noise here is well below 1/sqrt(3) of the gradient norm.
  assert qlayers.inspect.SQRT3_RULE == pytest.approx(0.57735, abs=1e-5)
  assert qlayers.inspect.noise_fallback(reps) == qlayers.convert.DEFAULT_RULES
  for bad in (0, -0.1, math.inf, math.nan):
    with pytest.raises(ValueError, match="threshold"):
      qlayers.inspect.noise_fallback(reps, bad)
  with pytest.raises(ValueError, match="gemm"):
    qlayers.inspect.gradient_noise(reps, gemm="bwd")
  with pytest.raises(TypeError, match="Report"):
    qlayers.inspect.gradient_noise([])


def test_rules_files_round_trip_and_read_a_sensitivity(tmp_path):
  rules = (qlayers.Rule(pattern="^(a|b)$", recipe=None),
           qlayers.Rule(pattern="/mlp/", recipe=qlayers.recipe("mxfp8"),
                        backend="xla"),
           qlayers.convert.KEEP_HEAD_WIDE)
  path = qlayers.inspect.save_rules(rules, tmp_path / "r.json")
  back = qlayers.inspect.load_rules(path)
  assert back[0] == rules[0] and back[2] == rules[2]
  assert back[1].recipe == "mxfp8" and back[1].backend == "xla"

  def proposal(wide):
    keep = qlayers.Rule(pattern=S.keep_wide_pattern(wide), recipe=None)
    return S.Proposal(wide=wide, loss=1.0, vs_wide_pct=0.0, vs_all_pct=0.0,
                      gap_closed=0.5, grad_sqnr_db=None,
                      rules=(keep, *qlayers.convert.DEFAULT_RULES))

  props = [proposal(("x",)), proposal(("x", "y/z"))]
  sens = S.Sensitivity(recipe="mxfp4", compute_dtype="bfloat16", batches=1,
                       wide_loss=1.0, all_loss=1.1, all_grad_sqnr_db=None,
                       layers=[], gemms=[], proposals=props,
                       proposed=props[1])
  sens.to_json(tmp_path / "s.json")
  assert qlayers.inspect.load_rules(tmp_path / "s.json") == props[1].rules
  # A rule's backend survives a sensitivity file; a recipe its name no
  # longer loads is refused rather than saved as the stock one.
  props[1] = dataclasses.replace(props[1], rules=rules[:2])
  sens.proposed = props[1]
  sens.to_json(tmp_path / "s2.json")
  assert qlayers.inspect.load_rules(tmp_path / "s2.json")[1].backend == "xla"
  changed = qlayers.Rule(pattern="x", recipe=qlayers.recipe(
      "fp8_delayed", amax_history_len=16))
  with pytest.raises(ValueError, match="not the recipe its name loads"):
    qlayers.inspect.save_rules((changed,), tmp_path / "c.json")
  assert qlayers.inspect.load_rules(tmp_path / "s.json", k=1) == props[0].rules
  with pytest.raises(ValueError, match="no proposal keeps 3"):
    qlayers.inspect.load_rules(tmp_path / "s.json", k=3)
  (tmp_path / "bad.json").write_text(json.dumps({"other": 1}))
  with pytest.raises(ValueError, match="bad.json has neither"):
    qlayers.inspect.load_rules(tmp_path / "bad.json")
  with pytest.raises(ValueError, match="missing.json"):
    qlayers.inspect.load_rules(tmp_path / "missing.json")
