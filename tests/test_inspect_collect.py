"""qlayers.inspect.collect: nothing cached on the loss function, and the
statistics read the operand the GEMM consumed (its BF16 rounding kept)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers

_factor = 1.0  # read by `_scaled_loss`; the tests rebind it


def _scaled_loss(m, x):
  return _factor * jnp.mean(m(x).astype(jnp.float32) ** 2)


def test_collect_reads_a_rebound_global_anew():
  global _factor
  layer = qlayers.QuantDense(64, 32, recipe="fp8_current", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (8, 64))
  losses = []
  try:
    for _factor in (1.0, 3.0):
      losses.append(qlayers.inspect.collect(layer, _scaled_loss, x).loss)
  finally:
    _factor = 1.0
  assert losses[1] == pytest.approx(3.0 * losses[0], rel=1e-6)


class _Scaled(nnx.Module):
  """A BF16 QuantDense whose input is computed in FP32 inside the graph
  (``x * c``) and rounded to BF16 by the layer."""

  def __init__(self, rngs):
    self.lin = qlayers.QuantDense(64, 32, recipe="mxfp8", dtype=jnp.bfloat16,
                                  rngs=rngs)

  def __call__(self, x, c):
    return self.lin(x * c)


def test_mxfp8_never_saturates_on_an_input_rounded_to_bf16():
  """The max of each block of 32 is 1.75 (1 + 2**-9) in FP32, which rounds
  to 1.75 in BF16: RCEIL gives the scale 1.75 / 448 = 2**-8 exactly. Read in
  FP32 (a statistic that recomputed the input without its BF16 rounding)
  the max would exceed 448 and count as saturated."""
  x = jax.random.uniform(jax.random.key(3), (32, 64))
  x = x.at[:, ::32].set(1.0 + 2.0**-9)
  rep = qlayers.inspect.collect(_Scaled(nnx.Rngs(0)),
                                lambda m, x, c: jnp.mean(
                                    m(x, c).astype(jnp.float32) ** 2),
                                x, jnp.float32(1.75))
  assert [r.role for r in rep.rows] == ["x", "w", "g"]
  for row in rep.rows:
    assert row.saturated == 0.0, row.role
    for gemm, st in row.gemms.items():
      assert st["saturated"] == 0.0, (row.role, gemm)
  amax = rep.row("lin", "x").amax
  assert amax == 1.75 == float(jnp.asarray(amax, jnp.bfloat16))
  for st in rep.row("lin", "x").gemms.values():
    assert st["amax"] == 1.75 and st["scale"] == 2.0**-8


_LAYERS = 3


class _Stack(nnx.Module):
  """Three QuantDense layers stacked by nnx.vmap and run by nnx.scan, or
  the same three layers (same weights) in a Python loop."""

  def __init__(self, scanned: bool, remat: bool = False):
    @nnx.split_rngs(splits=_LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return qlayers.QuantDense(32, 32, recipe="fp8_current", rngs=rngs)

    stack = make(nnx.Rngs(0))
    self.scanned, self.remat = scanned, remat
    if scanned:
      self.layers = stack
    else:
      self.layers = nnx.List([
          qlayers.QuantDense(32, 32, recipe="fp8_current", rngs=nnx.Rngs(0))
          for _ in range(_LAYERS)])
      for i, layer in enumerate(self.layers):
        layer.kernel[...] = stack.kernel[...][i]
        layer.bias[...] = stack.bias[...][i]

  def __call__(self, x):
    if not self.scanned:
      for layer in self.layers:
        x = layer(x) * 4.0
      return x

    def body(layer, x):
      return layer(x) * 4.0

    if self.remat:
      body = nnx.remat(body)
    return nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(
        self.layers, x)


@pytest.mark.parametrize("remat", [False, True])
def test_a_scanned_stack_is_measured_per_iteration_as_its_unrolled_layers(
    remat):
  # Each iteration's x, w and g (and so its dgrad/wgrad SQNR) come from that
  # iteration: the scan's rows equal those of the same layers unrolled. (The
  # forward runs iterations 0..2, the backward 2..0; pairing them by order
  # mixed iteration 2's x with iteration 0's g.)
  x = jax.random.normal(jax.random.key(1), (8, 32))
  loss_fn = lambda m, x: jnp.sum(m(x))
  scanned = qlayers.inspect.collect(_Stack(True, remat), loss_fn, x)
  unrolled = qlayers.inspect.collect(_Stack(False), loss_fn, x)
  assert scanned.paths == ["layers[0]", "layers[1]", "layers[2]"]
  assert unrolled.paths == ["layers/0", "layers/1", "layers/2"]
  for i in range(_LAYERS):
    for role in "xwg":
      got = scanned.row(f"layers[{i}]", role)
      want = unrolled.row(f"layers/{i}", role)
      assert got.amax == pytest.approx(want.amax, rel=1e-5), (i, role)
      assert got.sqnr_db == pytest.approx(want.sqnr_db, abs=0.05), (i, role)
    for gemm in ("fprop", "dgrad", "wgrad"):
      assert scanned.output(f"layers[{i}]", gemm) == pytest.approx(
          unrolled.output(f"layers/{i}", gemm), abs=0.05), (i, gemm)
  # The gradient grows backwards through the layers (x4 per layer).
  g = [scanned.row(f"layers[{i}]", "g").amax for i in range(_LAYERS)]
  assert g[0] > g[1] > g[2]


def test_einsum_experts_are_measured_per_expert_as_dense_gemms():
  # Each expert of a QuantExpertsEinsum is its own GEMM (its rows, its
  # weight, its scales): its rows equal a QuantDense's on that expert's
  # input and kernel, with the same upstream gradient.
  experts = qlayers.QuantExpertsEinsum("ecd,edf->ecf", (3, 32, 16),
                                       recipe="mxfp8", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 8, 32))
  x = x * jnp.array([1.0, 5.0, 0.25])[:, None, None]
  c = jax.random.normal(jax.random.key(2), (3, 8, 16))
  rep = qlayers.inspect.collect(experts, lambda m, x: jnp.sum(m(x) * c), x)
  assert rep.paths == ["(model)[0]", "(model)[1]", "(model)[2]"]
  for e in range(3):
    dense = qlayers.QuantDense(32, 16, use_bias=False, recipe="mxfp8",
                               rngs=nnx.Rngs(0))
    dense.kernel[...] = experts.kernel[...][e]
    want = qlayers.inspect.collect(
        dense, lambda m, x, e=e: jnp.sum(m(x) * c[e]), x[e])
    for role in "xwg":
      got, ref = rep.row(f"(model)[{e}]", role), want.row("(model)", role)
      assert (got.amax, got.scale, got.sqnr_db) == (
          ref.amax, ref.scale, ref.sqnr_db), (e, role)
    for gemm in ("fprop", "dgrad", "wgrad"):
      assert rep.output(f"(model)[{e}]", gemm) == pytest.approx(
          want.output("(model)", gemm), abs=1e-3), (e, gemm)


def test_sensitivity_reference_runs_einsum_experts_wide():
  class Net(nnx.Module):
    def __init__(self):
      self.experts = qlayers.QuantExpertsEinsum(
          "ecd,edf->ecf", (2, 32, 32), recipe="mxfp4", rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.experts(x)

  net = Net()
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
  result = qlayers.inspect.sensitivity(net, loss_fn, [(x,)], "mxfp4",
                                       gemms=False, grads=False)
  wide = nnx.Einsum("ecd,edf->ecf", (2, 32, 32), rngs=nnx.Rngs(0))
  wide.kernel[...] = net.experts.kernel[...]
  # The reference runs the experts wide (in BF16, the compute dtype): far
  # nearer the FP32 loss than the all-MXFP4 loss is.
  want = float(loss_fn(wide, x))
  assert result.wide_loss == pytest.approx(want, rel=2e-3)
  assert abs(result.wide_loss - want) < abs(result.all_loss - want) / 5


def test_einsum_experts_in_a_scan_are_named_by_layer_and_expert():
  # Their records came in another order inside the scan: moe[0][0] was
  # layer 0's expert 2. Each record now carries its expert.
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return qlayers.QuantExpertsEinsum("ecd,edf->ecf", (3, 32, 32),
                                      recipe="mxfp8", rngs=rngs)

  model = nnx.Dict(moe=make(nnx.Rngs(0)))

  def loss_fn(m, x):
    body = lambda layer, x: layer(x)
    return jnp.sum(nnx.scan(body, in_axes=(0, nnx.Carry),
                            out_axes=nnx.Carry)(m["moe"], x) ** 2)

  x = jax.random.normal(jax.random.key(1), (3, 4, 32))
  rep = qlayers.inspect.collect(model, loss_fn, x)
  w = np.asarray(model["moe"].kernel[...])
  for i in range(2):
    for e in range(3):
      got = rep.row(f"moe[{i}][{e}]", "w").amax
      assert got == pytest.approx(float(np.abs(w[i, e]).max()), rel=1e-6)


def test_an_empty_batch_is_named_in_the_reason_nothing_was_measured():
  layer = qlayers.QuantDense(40, 24, recipe="mxfp8", rngs=nnx.Rngs(0))
  rep = qlayers.inspect.collect(layer, lambda m, x: jnp.sum(m(x) ** 2),
                                jnp.ones((0, 40)))
  assert not rep.rows
  assert "empty batch" in dict(rep.skipped)["(model)"]


@nnx.jit
def _jitted_forward(m, x):
  return m(x)


def _loss_through_a_jit(m, x):
  return jnp.mean(_jitted_forward(m, x).astype(jnp.float32) ** 2)


def test_a_loss_function_calling_its_own_jit_is_measured_on_every_call():
  # The labelled model looked the same to the loss function's nnx.jit on
  # every call, so it replayed the first call's trace: later collects
  # measured nothing (their taps were the first's), a sensitivity after a
  # collect ran the collect's forward under every mask.
  model = nnx.Sequential(
      nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu,
      nnx.Linear(64, 32, rngs=nnx.Rngs(1)))
  measured = nnx.clone(model)
  qlayers.quantize(measured, "mxfp4")
  x = jax.random.normal(jax.random.key(0), (8, 64))
  for scale in (1.0, 3.0):
    rep = qlayers.inspect.collect(measured, _loss_through_a_jit, x * scale)
    assert rep.row("layers/0", "x").amax == pytest.approx(
        float(jnp.abs(x * scale).max()))
  plain = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
  want = qlayers.inspect.sensitivity(model, plain, [x], "mxfp4",
                                     gemms=False, grads=False)
  got = qlayers.inspect.sensitivity(model, _loss_through_a_jit, [x],
                                    "mxfp4", gemms=False, grads=False)
  assert got.wide_loss == pytest.approx(want.wide_loss)
  assert got.wide_loss != pytest.approx(got.all_loss)
  assert [c.path for c in got.layers] == [c.path for c in want.layers]
  assert [c.loss_delta_pct for c in got.layers] == pytest.approx(
      [c.loss_delta_pct for c in want.layers])
