"""qlayers.inspect: statistics on tensors with known answers, every recipe,
no state change, no trace change when off, sensitivity, the training hook."""

import csv
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers import dispatch
from qlayers import ops
from qlayers import scaling as S
from qlayers.inspect import masked, numerics
from _support.helpers import delayed, optax_rules, pure, train_step, weighted_sum
from _support.numerics import sqnr_db


def _shuffled(values, n, base=1.0, seed=0):
  """``n`` values: ``values`` is [(value, count)], the rest ``base``,
  shuffled."""
  out = np.full(n, base, np.float32)
  i = 0
  for v, c in values:
    out[i:i + c] = v
    i += c
  return np.random.default_rng(seed).permutation(out)


class Two(nnx.Module):
  """Two stacked linears (paths ``a`` and ``b``)."""

  def __init__(self, recipe, d=128, rngs=None):
    rngs = rngs or nnx.Rngs(0)
    self.a = qlayers.QuantDense(d, d, recipe=recipe, rngs=rngs)
    self.b = qlayers.QuantDense(d, d, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def mse(m, x):
  return jnp.mean(m(x).astype(jnp.float32) ** 2)


# ----------------------------------------------------------------------------
# Known answers


def test_underflow_known_fraction_per_tensor():
  # amax 448 -> E4M3 scale 1; 1e-5 is below half the smallest subnormal
  # (2**-9 / 2), so exactly those values flush to zero.
  n = 64 * 128
  x = jnp.asarray(_shuffled([(448.0, 1), (1e-5, n // 4)], n)).reshape(64, 128)
  q = S.quantize(x, S.QuantSpec(format="e4m3"), axis=1)
  st = numerics.operand_stats(x, q)
  assert float(st["underflow"]) == (n // 4) / n
  assert float(st["scale"]) == 1.0 and float(st["saturated"]) == 0.0

  layer = qlayers.QuantDense(128, 64, recipe="fp8_current", rngs=nnx.Rngs(0))
  rep = qlayers.inspect.collect(layer, mse, x)
  row = rep.row("(model)", "x")
  assert row.underflow == (n // 4) / n
  assert set(row.gemms) == {"fprop", "wgrad"}
  assert all(g["underflow"] == (n // 4) / n for g in row.gemms.values())


def test_underflow_known_fraction_mx():
  # MXFP4 (E2M1, RCEIL): a block whose amax is 6 gets scale 1; values under
  # half the smallest subnormal (0.5 / 2) flush, 1.0 is exact.
  rows, k = 16, 128
  blocks = []
  rng = np.random.default_rng(1)
  flushed = 0
  for _ in range(rows * k // 32):
    b = np.ones(32, np.float32)
    m = int(rng.integers(0, 8))
    b[1:1 + m] = 0.2
    b[0] = 6.0
    flushed += m
    blocks.append(rng.permutation(b))
  x = jnp.asarray(np.concatenate(blocks).reshape(rows, k))
  q = S.quantize(x, S.QuantSpec(format="e2m1", granularity="mx"), axis=1)
  st = numerics.operand_stats(x, q)
  assert float(st["underflow"]) == flushed / x.size
  assert float(st["scale"]) == 1.0 and float(st["scale_min"]) == 1.0


def test_saturation_above_a_stale_delayed_scale():
  # The history says amax 1.0, so the scale is 1/448; this step's values of
  # 2.0 land at 896 > 448 and clip: exactly those are saturated.
  layer = qlayers.QuantDense(128, 64, recipe=delayed(4), rngs=nnx.Rngs(0))
  layer.quant.x_amax_history[...] = jnp.array([1.0, 0.0, 0.0, 0.0])
  n = 32 * 128
  x = jnp.asarray(_shuffled([(2.0, n // 8), (-2.0, n // 16)], n, base=0.5)
                  ).reshape(32, 128)
  before = pure(nnx.state(layer))
  rep = qlayers.inspect.collect(layer, mse, x)
  row = rep.row("(model)", "x")
  assert row.saturated == (n // 8 + n // 16) / n
  assert row.scale == np.float32(1.0) / np.float32(448.0)
  assert row.history["used"] == 1.0 and row.history["ratio"] == 2.0
  assert row.history["filled"] == 1.0
  after = pure(nnx.state(layer))
  assert all(np.array_equal(before[k], after[k]) for k in before)


def test_current_scaling_never_counts_the_amax_as_saturated():
  x = jax.random.normal(jax.random.key(3), (64, 256)) * 37.0
  for spec in (S.QuantSpec(format="e4m3"), S.QuantSpec(format="e5m2"),
               S.QuantSpec(format="e4m3", granularity="row"),
               S.QuantSpec(format="e4m3", granularity="tile"),
               S.QuantSpec(format="e2m1", granularity="mx")):
    st = numerics.operand_stats(x, S.quantize(x, spec, axis=1))
    assert float(st["saturated"]) == 0.0, spec


def test_saturation_under_mx_floor():
  # FLOOR: a block amax of 7.5 gets scale 2**(2 - 2) = 1, and 7.5 > 6
  # saturates; the other values (1.0) do not.
  x = jnp.asarray(np.tile(np.r_[7.5, np.ones(31)], 8).astype(np.float32)
                  ).reshape(2, 128)
  q = S.quantize(x, S.QuantSpec(format="e2m1", granularity="mx",
                                scale_rule="mx_floor"), axis=1)
  assert float(numerics.operand_stats(x, q)["saturated"]) == 1 / 32


def test_sqnr_of_an_exactly_representable_tensor_is_infinite():
  # E4M3 values with amax 448 (scale exactly 1) survive quantization.
  grid = np.array([448.0, -448.0, 1.0, -0.5, 0.25, 3.5, -96.0, 0.0],
                  np.float32)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.choice(grid, (16, 128)))
  x = x.at[0, 0].set(448.0)
  layer = qlayers.QuantDense(128, 128, recipe="fp8_current", use_bias=False,
                             rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.asarray(rng.choice(grid, (128, 128))).at[0, 0].set(
      448.0)
  rep = qlayers.inspect.collect(layer, mse, x)
  assert rep.row("(model)", "x").sqnr_db == math.inf
  assert rep.row("(model)", "w").sqnr_db == math.inf
  assert rep.output("(model)", "fprop") == math.inf
  assert math.isfinite(rep.row("(model)", "g").sqnr_db)


def test_a_nan_in_an_operand_reads_as_an_infinite_amax():
  # XLA:CPU's vectorized max dropped the NaN: the x row read the max of
  # the rest, an all-NaN gradient -inf; the GEMM's own amax reads +Inf.
  layer = qlayers.QuantDense(128, 64, recipe="fp8_current", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (64, 128)).at[3, 5].set(jnp.nan)
  rep = qlayers.inspect.collect(layer, mse, x)
  for role in "xg":
    assert rep.row("(model)", role).amax == math.inf, role
    assert math.isnan(rep.row("(model)", role).scale), role


def test_a_transformed_stochastic_copy_is_the_gemms():
  # With a Hadamard transform and stochastic rounding (mxfp4_rht) the copy
  # measured drew its rounding from the transformed data, the GEMM's from
  # the untransformed: another copy (its output SQNR 0.3 dB off).
  recipe = qlayers.recipe("mxfp4_rht")
  g = jax.random.normal(jax.random.key(1), (64, 48))
  for use in numerics.uses(recipe, "g"):
    assert use.hadamard and use.spec.stochastic
    _, q = numerics.quantized_copy(g, use, None, recipe)
    want = ops.operand(g, dispatch.Operand.make(use.spec, use.axis,
                                                use.hadamard))
    np.testing.assert_array_equal(np.asarray(q.payload),
                                  np.asarray(want.payload))


def test_a_frozen_kernel_has_no_weight_gradient_to_measure():
  # Its layer runs no Wgrad GEMM, yet its Wgrad was measured, and
  # noise_fallback proposed keeping it wide for that noise.
  model = Two("mxfp4")
  qlayers.freeze(model.b)  # its Dgrad runs: a's weight takes a gradient
  rep = qlayers.inspect.collect(model, mse, jnp.ones((8, 128)))
  assert [(o.path, o.gemm) for o in rep.outputs] == [
      ("a", "fprop"), ("a", "dgrad"), ("a", "wgrad"), ("b", "fprop"),
      ("b", "dgrad")]
  assert sorted(rep.row("b", "x").gemms) == ["fprop"]
  assert sorted(rep.row("b", "g").gemms) == ["dgrad"]
  assert list(qlayers.inspect.gradient_noise(rep)) == ["a"]


def test_sqnr_of_uniform_rounding_noise():
  # x ~ U[1, 2) under MXFP8 (E4M3, RCEIL) lands on a grid of spacing 1/8
  # (scale 2**-7 or 2**-8, see the docstring of mx_scale_codes), so the
  # rounding error is uniform on +-1/16: noise power (1/8)**2 / 12 against
  # signal power E[x^2] = 7/3.
  x = jax.random.uniform(jax.random.key(0), (256, 256), minval=1.0,
                         maxval=2.0)
  q = S.quantize(x, S.QuantSpec(format="e4m3", granularity="mx"), axis=1)
  expected = 10 * math.log10((7 / 3) / ((1 / 8) ** 2 / 12))  # 32.53 dB
  got = float(numerics.operand_stats(x, q)["sqnr_db"])
  assert abs(got - expected) < 0.1, (got, expected)
  assert got == pytest.approx(sqnr_db(x, q.dequantize()), abs=1e-3)


def test_output_gradient_statistics_of_a_known_gradient():
  # loss = sum(y * c): the output gradient is exactly c. E5M2 with amax
  # 57344 has scale 1, and 1e-6 is under half its smallest subnormal
  # (2**-16 / 2).
  m, n = 32, 128
  c = jnp.asarray(_shuffled([(57344.0, 1), (1e-6, m * n // 4)], m * n)
                  ).reshape(m, n)
  layer = qlayers.QuantDense(128, n, recipe="fp8_current", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (m, 128))
  rep = qlayers.inspect.collect(layer, lambda mod, x: weighted_sum(mod(x), c),
                                x)
  row = rep.row("(model)", "g")
  assert row.format == "e5m2" and set(row.gemms) == {"dgrad", "wgrad"}
  assert row.amax == 57344.0 and row.scale == 1.0
  assert row.underflow == 0.25
  q = S.quantize(c, S.QuantSpec(format="e5m2"), axis=1)
  assert row.sqnr_db == pytest.approx(
      float(numerics.operand_stats(c, q)["sqnr_db"]), abs=1e-4)


def test_output_sqnr_matches_the_fake_quant_oracle():
  x = jax.random.normal(jax.random.key(0), (64, 128))
  for name in ("fp8_current", "mxfp8"):
    layer = qlayers.QuantDense(128, 64, recipe=name, use_bias=False,
                               rngs=nnx.Rngs(0))
    rep = qlayers.inspect.collect(layer, mse, x)
    w = layer.kernel[...]
    ref = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    expected = sqnr_db(ref, ops.fake_quant_matmul(x, w, name))
    assert rep.output("(model)", "fprop") == pytest.approx(expected, abs=0.01)


# ----------------------------------------------------------------------------
# Every recipe; state; the trace when off


@pytest.mark.parametrize("name", qlayers.available_recipes())
def test_every_recipe(name):
  model = Two(name)
  x = jax.random.normal(jax.random.key(0), (32, 128))
  rep = qlayers.inspect.collect(model, mse, x)
  r = qlayers.recipe(name)
  assert math.isfinite(rep.loss)
  if not r.quantized:
    assert not rep.rows and not rep.outputs
    assert {p for p, _ in rep.skipped} == {"a", "b"}
    assert all("quantizes nothing" in why for _, why in rep.skipped)
    return
  assert [(x.path, x.role) for x in rep.rows] == [
      (p, role) for p in ("a", "b") for role in ("x", "w", "g")]
  assert [(o.path, o.gemm) for o in rep.outputs] == [
      (p, g) for p in ("a", "b") for g in ("fprop", "dgrad", "wgrad")]
  floor = {"mxfp4": 10.0, "mxfp4_rht": 10.0, "mxfp4_mlperf": 10.0,
           "nvfp4": 10.0, "mxfp6": 15.0}.get(name, 20.0)
  # NVFP4's E4M3 block scale may round below amax / 6: then the block's
  # largest element clips to 6 (as in Transformer Engine), under 1 in 16.
  clipped = 1 / 16 if name == "nvfp4" else 0.0
  for row in rep.rows:
    assert len(row.gemms) == 2
    assert floor < row.sqnr_db < 60, (row.path, row.role, row.sqnr_db)
    assert row.saturated <= clipped, (row.path, row.role, row.saturated)
    assert (row.history is not None) == r.delayed
  for o in rep.outputs:
    assert floor - 6 < o.sqnr_db < 60, (o.path, o.gemm, o.sqnr_db)


def test_no_model_state_changes():
  model = Two(delayed(8), d=64)
  x = jax.random.normal(jax.random.key(0), (16, 64))
  opt = qlayers.Optimizer(model, optax_sgd())
  step = train_step(mse)
  with optax_rules():
    for _ in range(3):
      step(model, opt, x)
  assert float(model.a.quant.g_amax_history[0]) > 0
  for mode in ("train", "eval"):
    getattr(model, mode)()
    before = pure(nnx.state(model))
    rep = qlayers.inspect.collect(model, mse, 3.0 * x)
    after = pure(nnx.state(model))
    assert before.keys() == after.keys()
    for k in before:
      assert np.array_equal(before[k], after[k]), (mode, k)
    # The scale comes from the stored history, as a training step's would.
    hist = np.asarray(model.a.quant.x_amax_history[...])
    row = rep.row("a", "x")
    assert row.history["used"] == hist.max()
    assert row.scale == pytest.approx(hist.max() / 448.0, rel=1e-6)
    assert row.history["filled"] == 3.0


def optax_sgd():
  import optax  # pylint: disable=g-import-not-at-top
  return optax.sgd(0.1)


def test_hook_off_leaves_the_trace_unchanged():
  model = Two("fp8_delayed", d=64)
  x = jnp.ones((8, 64))

  def lowered():
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, x: mse(nnx.merge(graphdef, s), x))
    return f.lower(state, x).as_text()

  before = lowered()
  released = lambda: qlayers.ops.intercept(lambda *a, **k: None)  # noqa: E731
  qlayers.inspect.collect(model, mse, x)
  with released():  # the hook was handed back
    pass
  assert lowered() == before
  with pytest.raises(ZeroDivisionError):
    qlayers.inspect.collect(model, lambda m, x: 1 / 0, x)
  with released():
    pass
  assert lowered() == before


def test_dot_general_callers_and_repeated_layers():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(64, 64, rngs=rngs,
                            dot_general=qlayers.QuantGemm("fp8_current"))
      self.gen = qlayers.QuantLinearGeneral(64, (2, 32), recipe="mxfp8",
                                            rngs=rngs)

    def __call__(self, x):
      h = self.lin(self.lin(x))  # the same layer twice
      return self.gen(h)

  rep = qlayers.inspect.collect(Net(nnx.Rngs(0)), mse, jnp.ones((4, 64)))
  assert [(r.path, r.use, r.role) for r in rep.rows] == [
      ("lin", 0, "x"), ("lin", 0, "w"), ("lin", 0, "g"),
      ("lin", 1, "x"), ("lin", 1, "w"), ("lin", 1, "g"),
      ("gen", 0, "x"), ("gen", 0, "w"), ("gen", 0, "g")]
  assert rep.row("gen", "x").format == "e4m3"
  assert "lin#1/x/sqnr_db" in rep.scalars()


def test_identical_layers_share_one_statistics_program():
  """The statistics are measured outside the pass, one program per distinct
  (shapes, recipe): a deep stack of equal layers compiles them once, each
  layer still gets its own numbers, and a second `collect` (a `Monitor`'s
  next record) compiles none."""
  # pylint: disable=protected-access
  collect_module = sys.modules["qlayers.inspect.collect"]
  programs = (collect_module._forward_stats, collect_module._backward_stats)
  for fn in programs:
    fn.clear_cache()

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([
          qlayers.QuantDense(96, 96, recipe="fp8_delayed", rngs=rngs)
          for _ in range(4)])

    def __call__(self, x):
      for layer in self.layers:
        x = jnp.tanh(layer(x))
      return x

  model = Stack(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (16, 96), jnp.float32)
  rep = qlayers.inspect.collect(model, mse, x)
  assert [fn._cache_size() for fn in programs] == [1, 1]
  again = qlayers.inspect.collect(model, mse, x * 2)
  assert [fn._cache_size() for fn in programs] == [1, 1]
  assert again.row("layers/0", "x").amax == 2 * rep.row("layers/0", "x").amax
  w = [rep.row(f"layers/{i}", "w").amax for i in range(4)]
  np.testing.assert_allclose(
      w, [float(jnp.max(jnp.abs(l.kernel[...]))) for l in model.layers])
  assert len(set(w)) == 4


def test_layers_outside_quantgemm_are_listed():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.body = qlayers.QuantDense(64, 64, recipe="mxfp8", rngs=rngs)
      self.head = qlayers.QuantLogits(64, 96, recipe="mxfp8", rngs=rngs)
      self.unused = qlayers.QuantDense(64, 64, recipe="mxfp8", rngs=rngs)

    def __call__(self, x):
      return self.head(self.body(x))

  rep = qlayers.inspect.collect(Net(nnx.Rngs(0)), mse, jnp.ones((4, 64)))
  assert rep.paths == ["body"]
  assert [p for p, _ in rep.skipped] == ["head", "unused"]
  assert "not inspected: head" in rep.table()


def test_bad_input():
  layer = qlayers.QuantDense(64, 64, recipe="mxfp8", rngs=nnx.Rngs(0))
  x = jnp.ones((4, 64))
  with pytest.raises(TypeError, match="scalar"):
    qlayers.inspect.collect(layer, lambda m, x: m(x), x)
  with pytest.raises(TypeError, match="nnx.Module"):
    qlayers.inspect.collect(lambda x: x, mse, x)

  @nnx.jit
  def inside(m, x):
    return qlayers.inspect.collect(m, mse, x)
  with pytest.raises(RuntimeError, match="outside jit"):
    inside(layer, x)
  rep = qlayers.inspect.collect(layer, mse, x)
  with pytest.raises(KeyError, match="layers"):
    rep.row("nope", "x")


def test_json_table_and_plot(tmp_path):
  pytest.importorskip("matplotlib")
  model = Two("mxfp4", d=64)
  x = jnp.ones((8, 64))  # ones are exact: infinite SQNR for x
  rep = qlayers.inspect.collect(model, mse, x)
  data = json.loads(rep.to_json(tmp_path / "r.json"))
  assert json.loads((tmp_path / "r.json").read_text()) == data
  assert data["rows"][0]["sqnr_db"] == "inf"
  assert {r["role"] for r in data["rows"]} == {"x", "w", "g"}
  assert "e2m1/mx" in rep.table()
  png = rep.plot(tmp_path / "r.png")
  assert png.stat().st_size > 10_000
  with pytest.raises(ValueError, match="no rows"):
    rep.plot(tmp_path / "none.png", layers="^nothing$")


# ----------------------------------------------------------------------------
# The training hook


def test_monitor_records_every_n_steps(tmp_path):
  pytest.importorskip("matplotlib")
  model = Two(delayed(16), d=64)
  opt = qlayers.Optimizer(model, optax_sgd())
  step = train_step(mse)
  seen = []
  mon = qlayers.inspect.Monitor(mse, every=2, layers="^a$",
                                callback=lambda s, d: seen.append((s, d)))
  key = jax.random.key(0)
  for i in range(5):
    x = jax.random.normal(jax.random.fold_in(key, i), (16, 64)) * (1 + i)
    got = mon(i, model, x)
    assert (got is None) == (i % 2 == 1)
    with optax_rules():
      step(model, opt, x)
  assert [s for s, _ in seen] == [0, 2, 4]
  assert all(isinstance(v, float) for _, d in seen for v in d.values())
  assert all(k == "loss" or k.startswith("a/") for k in seen[0][1])
  steps, used = mon.series("a/x/history_used")
  assert steps == [0, 2, 4] and used[0] < used[1] < used[2]  # scale moves
  with mon.to_csv(tmp_path / "m.csv").open() as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [0, 2, 4]
  assert mon.plot(tmp_path / "amax.png").stat().st_size > 10_000
  assert qlayers.inspect.plot_amax_history(
      model, tmp_path / "hist.png").stat().st_size > 10_000
  with pytest.raises(ValueError, match="delayed"):
    qlayers.inspect.plot_amax_history(Two("mxfp8", d=64), tmp_path / "x.png")
  with pytest.raises(ValueError, match="every"):
    qlayers.inspect.Monitor(mse, every=0)


# ----------------------------------------------------------------------------
# Sensitivity


@pytest.mark.parametrize("name", ["fp8_current", "mxfp4", "mxfp4_rht",
                                  "deepseek_v3", "fp8_delayed"])
def test_masked_matmul_all_on_is_the_op_and_all_off_is_wide(name):
  r = qlayers.recipe(name)
  x = jax.random.normal(jax.random.key(0), (64, 128)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (128, 128)) * 0.05
  state = ops.init_state(r)

  def loss(fn, x, w, st, *mask):
    return jnp.sum(fn(x, w, st, *mask)[0].astype(jnp.float32) ** 2)

  # The state is differentiated too, as a training step does (its gradient
  # amax leaves the backward pass of a delayed recipe).
  vg = jax.jit(jax.value_and_grad(loss, (1, 2, 3)), static_argnums=0)

  def masked_fn(x, w, st, mask):
    return masked.masked_matmul(x, w, r, st, mask)

  def masked_vg(mask):
    # The mask is traced, as in `sensitivity`: one compilation of the
    # switch serves every mask below.
    return vg(masked_fn, x, w, state, jnp.array(mask, jnp.float32))

  def same(a, b):
    return all(bool(jnp.array_equal(u, v))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  # All on: the library's op itself, bit for bit (its gradient amax too).
  real = vg(lambda x, w, st: ops.quantized_matmul(x, w, r, st), x, w, state)
  assert same(real, masked_vg([1, 1, 1]))
  wide = vg(lambda x, w, st: ops.quantized_matmul(x, w, "bf16"), x, w, state)
  off = masked_vg([0, 0, 0])
  assert same(wide[0], off[0]) and same(wide[1][:2], off[1][:2])
  # One GEMM at a time: Fprop alone changes the loss, Dgrad alone only dx,
  # Wgrad alone only dw.
  changed = {}
  for gemm, mask in (("fprop", [1, 0, 0]), ("dgrad", [0, 1, 0]),
                     ("wgrad", [0, 0, 1])):
    got = masked_vg(mask)
    changed[gemm] = tuple(not same(a, b) for a, b in (
        (got[0], off[0]), (got[1][0], off[1][0]), (got[1][1], off[1][1])))
  assert changed == {"fprop": (True, True, True),
                     "dgrad": (False, True, False),
                     "wgrad": (False, False, True)}


class Parallel(nnx.Module):
  """``a(x1) + b(x2)``: ``b``'s weights and inputs are exact in MXFP4."""

  def __init__(self, rngs):
    self.a = nnx.Linear(64, 64, use_bias=False, rngs=rngs)
    self.b = nnx.Linear(64, 64, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x1, x2):
    return self.head(self.a(x1) + self.b(x2))


def _e2m1_exact(key, shape):
  """Values on the E2M1 grid with a 6 in every block of 32 (scale 1)."""
  grid = jnp.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0, -1.0, -3.0])
  v = jax.random.choice(key, grid, shape)
  return v.at[..., ::32].set(6.0)


def test_sensitivity_ranks_the_lossy_layer_and_its_rule_closes_the_gap():
  model = Parallel(nnx.Rngs(0))
  model.b.kernel[...] = _e2m1_exact(jax.random.key(1), (64, 64))
  batches = [(jax.random.normal(jax.random.key(10 + i), (16, 64)),
              _e2m1_exact(jax.random.key(20 + i), (16, 64)))
             for i in range(2)]
  # The target is the model's own FP32 output: the BF16 pass is close to it,
  # and MXFP4 noise on ``a`` moves it away.
  targets = {i: model(*b) for i, b in enumerate(batches)}
  batches = [(*b, targets[i]) for i, b in enumerate(batches)]

  def loss_fn(m, x1, x2, target):
    return jnp.mean((m(x1, x2) - target) ** 2)

  before = pure(nnx.state(model))
  res = qlayers.inspect.sensitivity(model, loss_fn, batches, "mxfp4",
                                    max_wide=2)
  after = pure(nnx.state(model))
  assert all(np.array_equal(before[k], after[k]) for k in before)
  assert type(model.a) is nnx.Linear  # the model itself is not converted

  assert [c.path for c in res.layers] == ["a", "b"]  # head stays wide
  b = res.layers[1]
  assert b.loss == res.wide_loss and b.loss_delta_pct == 0.0
  gemms = {(c.path, c.gemm): c for c in res.gemms}
  for gemm in ("dgrad", "wgrad"):  # not in the forward
    assert gemms["a", gemm].loss_delta_pct == 0.0
  # a's Wgrad makes a's kernel gradient; its Dgrad only the gradient of the
  # model's input, which no parameter receives.
  assert math.isfinite(gemms["a", "wgrad"].grad_sqnr_db)
  assert gemms["a", "dgrad"].grad_sqnr_db == math.inf
  # b's operands are exact in MXFP4: its Fprop changes nothing.
  assert gemms["b", "fprop"].loss_delta_pct == 0.0
  assert gemms["b", "fprop"].grad_sqnr_db == math.inf
  assert res.all_loss != res.wide_loss
  one = res.proposals[0]
  assert one.wide == ("a",) and one.loss == res.wide_loss
  assert one.gap_closed == 1.0 and res.proposed is one
  assert res.rules()[0] == qlayers.Rule(pattern="^(a)$", recipe=None)
  # The proposed rules convert the model as measured.
  conv = qlayers.quantize(nnx.clone(model), "mxfp4", res.rules())
  assert [c.path for c in conv.converted] == ["b"]
  data = json.loads(res.to_json())
  assert data["proposed"]["pattern"] == "^(a)$"
  assert "Keeping the top k layers wide" in res.table()


_offset = 0.0  # read by the loss of the next test, which rebinds it


def test_sensitivity_reads_a_rebound_global_anew():
  global _offset
  model = Parallel(nnx.Rngs(0))
  batch = (jnp.ones((4, 64)), jnp.ones((4, 64)))

  def loss_fn(m, a, b):
    return jnp.mean(m(a, b) ** 2) + _offset

  wide = []
  try:
    for _offset in (0.0, 5.0):
      # (a delayed recipe: its masked GEMMs warn of no lost gradient amax)
      wide.append(qlayers.inspect.sensitivity(
          model, loss_fn, [batch], "fp8_delayed", gemms=False, grads=False,
          max_wide=1).wide_loss)
  finally:
    _offset = 0.0
  assert wide[1] == pytest.approx(wide[0] + 5.0, rel=1e-6)


def test_sensitivity_errors():
  model = Parallel(nnx.Rngs(0))
  batch = (jnp.ones((4, 64)), jnp.ones((4, 64)))
  loss_fn = lambda m, a, b: jnp.mean(m(a, b) ** 2)
  with pytest.raises(ValueError, match="quantizes nothing"):
    qlayers.inspect.sensitivity(model, loss_fn, [batch], "bf16")
  with pytest.raises(ValueError, match="at least one batch"):
    qlayers.inspect.sensitivity(model, loss_fn, [], "mxfp8")
  with pytest.raises(ValueError, match="max_wide"):
    qlayers.inspect.sensitivity(model, loss_fn, [batch], "mxfp8",
                                max_wide=5)
  with pytest.raises(ValueError, match="No layer"):
    qlayers.inspect.sensitivity(
        model, loss_fn, [batch], "mxfp8",
        rules=[qlayers.Rule(pattern="", recipe=None)])
  with pytest.raises(TypeError, match="batches is one array"):
    qlayers.inspect.sensitivity(model, lambda m, a: loss_fn(m, a, a),
                                jnp.ones((4, 64)), "mxfp8")
  with pytest.raises(TypeError, match=r"tuple of 2 arrays; pass a list: "
                     r"\[\(x, y\)\]"):  # was: missing argument 'y'
    qlayers.inspect.sensitivity(model, loss_fn, batch, "mxfp8")
  nan = (batch[0].at[0, 0].set(jnp.nan), batch[1])
  with pytest.raises(ValueError, match="loss is not finite"):
    qlayers.inspect.sensitivity(model, loss_fn, [nan], "mxfp8")


def test_sensitivity_names_layers_it_cannot_measure_under_the_recipe():
  """Layers with no stock form (experts built directly, a stock layer
  given a QuantGemm by hand) kept their own recipe and were measured and
  ranked under it, in silence (found by audit)."""
  loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
  x = jnp.ones((16, 32))

  class Experts(nnx.Module):
    def __init__(self, recipe):
      self.a = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
      self.ex = qlayers.QuantExperts(2, 32, 32, recipe=recipe,
                                     rngs=nnx.Rngs(1))
    def __call__(self, x):
      return self.ex(self.a(x), jnp.array([6, 10]))

  class ByHand(nnx.Module):
    def __init__(self, recipe):
      self.lin = nnx.Linear(32, 32, rngs=nnx.Rngs(0),
                            dot_general=qlayers.QuantGemm(recipe))
    def __call__(self, x):
      return self.lin(x)

  with pytest.raises(ValueError, match=r"ex \(QuantExperts, already "
                     r"quantized \(fp8_delayed\)\) cannot be converted back"):
    qlayers.inspect.sensitivity(Experts("fp8_delayed"), loss_fn, [x],
                                "mxfp4", gemms=False)
  with pytest.raises(ValueError, match=r"lin \(a stock layer running "
                     r"QuantGemm\('fp8_delayed'\)"):
    qlayers.inspect.sensitivity(ByHand("fp8_delayed"), loss_fn, [x],
                                "mxfp4", gemms=False)
  # Built with the recipe measured: nothing to convert, measured as is.
  result = qlayers.inspect.sensitivity(Experts("mxfp4"), loss_fn, [x],
                                       "mxfp4", gemms=False)
  assert [c.path for c in result.layers if c.path == "ex"] == ["ex"]


def test_masked_matmul_refuses_a_mask_it_has_no_branch_for():
  """A mask outside ``masks`` is an error eagerly and NaN under a trace,
  never the first branch's value."""
  r = qlayers.recipe("mxfp8")
  x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
  masks = ((0, 0, 0), (1, 0, 0))
  with pytest.raises(ValueError, match="not among the masks"):
    masked.masked_matmul(x, w, r, None, jnp.array([1.0, 1.0, 1.0]),
                         masks=masks)
  run = jax.jit(lambda m: masked.masked_matmul(x, w, r, None, m,
                                               masks=masks)[0])
  assert np.isnan(np.asarray(run(jnp.array([1.0, 1.0, 1.0])))).all()
  y = np.asarray(run(jnp.array([1.0, 0.0, 0.0])))
  assert np.isfinite(y).all() and (y == 64.0).all()


def test_collect_refuses_a_model_without_quantized_gemms():
  # It returned an empty report (and rep.plot raised "nothing to plot").
  with pytest.raises(ValueError, match="quantized copy"):
    qlayers.inspect.collect(nnx.Linear(8, 8, rngs=nnx.Rngs(0)),
                            lambda m, x: jnp.sum(m(x)), jnp.ones((2, 8)))


def test_monitor_skips_a_model_without_quantized_gemms():
  # The same script's wide baseline run: collect refuses such a model.
  monitor = qlayers.inspect.Monitor(lambda m, x: jnp.sum(m(x)), every=1)
  assert monitor(0, nnx.Linear(8, 8, rngs=nnx.Rngs(0)), jnp.ones((2, 8))) \
      is None


@pytest.mark.parametrize("on", [(1, 0, 0), (0, 0, 0)])
def test_variants_of_a_step_keyed_recipe_drop_the_key_with_its_operands(on):
  # nvfp4 rounds only its gradients stochastically: keeping sr_key="step"
  # on a variant without them was refused, so sensitivity failed on nvfp4.
  r = masked.variant(qlayers.recipe("nvfp4"), on)
  assert not r.stochastic and r.sr_key == "data"
  assert masked.variant(qlayers.recipe("nvfp4"), (1, 1, 0)).sr_key == "step"


def test_a_block_flushed_by_a_zero_scale_is_underflow_not_saturation():
  # NVFP4: a quiet 1x16 block's E4M3 scale rounds to 0; its payload
  # saturates (multiplier FLT_MAX) but it dequantizes to 0.
  x = np.zeros((1, 32), np.float32)
  x[0, 0] = 1000.0
  x[0, 16:] = np.linspace(1e-4, 1e-3, 16)
  r = qlayers.recipe("nvfp4")
  t, q = numerics.quantized_copy(jnp.asarray(x), numerics.uses(r, "x")[0],
                                 None, r)
  assert float(np.asarray(q.scale).ravel()[1]) == 0
  st = numerics.operand_stats(t, q)
  assert float(st["underflow"]) == 0.5 and float(st["saturated"]) == 0
