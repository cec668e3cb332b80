"""Fault injection in a real training loop, for every recipe family.

NaN and Inf are put into activations (the model's input, a hidden
activation) and into gradients (the cotangent reaching a layer's output) at
chosen steps of a `qlayers.value_and_grad` + `qlayers.Optimizer` loop. On
those steps the Params and the optimizer's moments must stay bit-identical
and the skip must be counted; the quantization state must stay finite on
every step; and training must go on as if the bad batches had not been
there: bit for bit for recipes without stored scales, within a stated
tolerance for delayed scaling (whose histories record the skipped steps'
finite amaxes, and 0 for the non-finite ones).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers

from _support.helpers import pure

D = 128  # 1x128 tiles and 128x128 blocks need whole tiles
STEPS = 10
# step -> (where, value): "x" the input, "h" the hidden activation, "gy" /
# "gh" the gradient reaching the output / the hidden activation.
FAULTS = {2: ("x", np.nan), 4: ("h", np.inf), 6: ("gy", np.nan),
          8: ("gh", -np.inf)}
FAMILIES = ["bf16", "fp8_delayed", "fp8_current", "fp8_rowwise",
            "deepseek_v3", "mxfp8", "mxfp4"]
# Final-loss tolerance of delayed scaling against the clean run (relative).
DELAYED_RTOL = 0.02
# One optimizer transformation for every run: the faulty and the clean run
# of a recipe share one compiled step (a new optax.adam is a new static
# argument of `_step`, which would compile the step again).
TX = optax.adam(1e-2)


@jax.custom_vjp
def _poison_grad(y, value):
  """Identity whose backward pass adds ``value`` to one cotangent element
  (0 leaves it exact, NaN/Inf poisons it)."""
  return y


def _poison_fwd(y, value):
  return y, value


def _poison_bwd(value, g):
  return g.at[0, 0].add(value.astype(g.dtype)), jnp.zeros_like(value)


_poison_grad.defvjp(_poison_fwd, _poison_bwd)


class MLP(nnx.Module):

  def __init__(self, recipe, rngs):
    self.up = qlayers.QuantDense(D, D, recipe=recipe, dtype=jnp.bfloat16,
                                 rngs=rngs)
    self.down = qlayers.QuantDense(D, D, recipe=recipe, dtype=jnp.bfloat16,
                                   rngs=rngs)

  def __call__(self, x, faults):
    h = jax.nn.gelu(self.up(x))
    h = _poison_grad(h + faults["h"].astype(h.dtype), faults["gh"])
    return _poison_grad(self.down(h), faults["gy"])


def _loss(model, x, y, faults):
  out = model(x + faults["x"], faults)
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@nnx.jit
def _step(model, opt, x, y, faults):
  loss, grads = qlayers.value_and_grad(_loss)(model, x, y, faults)
  with jax.numpy_dtype_promotion("standard"):  # optax's decay ** count
    opt.update(model, grads)
  return loss


@functools.cache
def _data():
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(STEPS, 32, D)).astype(np.float32)
  w = rng.normal(size=(D, D)).astype(np.float32) / np.sqrt(D)
  ys = np.tanh(xs @ w)
  return xs, ys


def _faults(step):
  """The fault arrays of ``step`` (zeros where nothing is injected)."""
  f = {"x": np.zeros((32, D), np.float32), "h": np.zeros((32, D), np.float32),
       "gy": np.float32(0), "gh": np.float32(0)}
  if step in FAULTS:
    where, value = FAULTS[step]
    if where in ("x", "h"):
      f[where][3, 5] = value
    else:
      f[where] = np.float32(value)
  return {k: jnp.asarray(v) for k, v in f.items()}


def _quant_state(model):
  return {k: v for k, v in pure(nnx.state(
      model, (qlayers.QuantVariable, qlayers.QuantGradState))).items()}


def _train(recipe, steps):
  """Trains on the batches of ``steps`` (in order), injecting each step's
  faults; returns per-step records and the model."""
  xs, ys = _data()
  model = MLP(recipe, nnx.Rngs(0))
  opt = qlayers.Optimizer(model, TX)
  records = []
  for step in steps:
    before = pure(nnx.state(model, nnx.Param)), pure(opt.opt_state)
    skipped = int(opt.skipped_steps)
    loss = float(_step(model, opt, jnp.asarray(xs[step]),
                       jnp.asarray(ys[step]), _faults(step)))
    records.append({
        "step": step, "loss": loss, "before": before,
        "after": (pure(nnx.state(model, nnx.Param)), pure(opt.opt_state)),
        "skipped": int(opt.skipped_steps) - skipped,
        "state": _quant_state(model)})
  return records, model


_eval_step = nnx.jit(_loss)  # compiled once per recipe, not run op by op


def _eval_loss(model):
  xs, ys = _data()
  model.eval()
  loss = float(_eval_step(model, jnp.asarray(xs[0]), jnp.asarray(ys[0]),
                          _faults(-1)))
  model.train()
  return loss


@pytest.mark.parametrize("recipe", FAMILIES)
def test_faults_are_skipped_counted_and_leave_no_trace(recipe):
  faulty, model = _train(recipe, range(STEPS))
  for r in faulty:
    bad = r["step"] in FAULTS
    assert r["skipped"] == int(bad), r["step"]
    for k, v in r["state"].items():
      assert np.isfinite(v).all(), (r["step"], k)
    params_b, opt_b = r["before"]
    params_a, opt_a = r["after"]
    same = all(np.array_equal(params_b[k], params_a[k]) for k in params_b)
    assert same == bad, f"step {r['step']}: Params changed={not same}"
    if bad:  # moments too (the skip counter is the only change)
      changed = [k for k in opt_b if not np.array_equal(
          opt_b[k], opt_a[k], equal_nan=True)]
      assert all("skipped" in k for k in changed), changed

  clean, clean_model = _train(recipe, [s for s in range(STEPS)
                                       if s not in FAULTS])
  recovered = [r["loss"] for r in faulty if r["step"] not in FAULTS]
  expected = [r["loss"] for r in clean]
  got, want = _eval_loss(model), _eval_loss(clean_model)
  if qlayers.recipe(recipe).delayed:
    np.testing.assert_allclose(got, want, rtol=DELAYED_RTOL)
    np.testing.assert_allclose(recovered, expected, rtol=DELAYED_RTOL)
  else:  # nothing stored: the bad batches leave no trace at all
    assert recovered == expected
    assert got == want
    params, clean_params = (pure(nnx.state(m, nnx.Param))
                            for m in (model, clean_model))
    for k in params:
      assert np.array_equal(params[k], clean_params[k]), k
  assert expected[-1] < expected[0]  # it trains
