"""The optax wrappers of qlayers.optim_wrappers, alone on plain arrays:
hand-computed trajectories of master_weights, cast_moments,
skip_if_nonfinite, dynamic_loss_scaling and their composition
mixed_precision, and the helpers finite_norm, find_state, needs_master."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from qlayers import optim_wrappers as ow


def bits(x):
  """The bit patterns of ``x`` (so -0.0 != 0.0 and NaN == NaN)."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def assert_bits_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(bits(x), bits(y))


@contextlib.contextmanager
def count_compiles():
  """Yields the list of the programs XLA compiles in the block (JAX's own
  compile log, so a compile is counted whatever its duration)."""
  names = []

  class Handler(logging.Handler):

    def emit(self, record):
      msg = record.getMessage()
      if msg.startswith("Compiling "):
        names.append(msg.split(" with ")[0][len("Compiling "):])

  handler, logger = Handler(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logger.removeHandler(handler)


# ==========================================================================
# finite_norm, needs_master, find_state, masters of Variables


@pytest.mark.parametrize("jit", [False, True])
def test_finite_norm_finds_any_nonfinite_element(jit):
  check = jax.jit(ow.finite_norm) if jit else ow.finite_norm
  big = jnp.ones((3, 4097), jnp.float32)  # past the vectorized float max
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  clean = {"a": big.at[0, 0].set(1e18),  # its square is 1e36 < 3.4e38
           "b": jnp.full((5,), tiny, jnp.bfloat16),
           "c": jnp.array([-65504.0], jnp.float16),  # squared past FP16's max
           "d": jnp.array([448.0, -0.0], jnp.float8_e4m3fn),
           "e": jnp.zeros((0, 3)), "f": jnp.ones((2, 3, 5), jnp.bfloat16),
           "g": jnp.float32(2.0), "i": jnp.arange(4)}
  assert bool(check(clean))
  assert bool(check({})) and bool(check({"i": jnp.arange(3)}))
  bad = [("a", (2, 4096), jnp.nan), ("a", (1, 17), -jnp.inf),
         ("b", (4,), jnp.inf), ("c", (0,), jnp.nan), ("d", (1,), jnp.nan),
         ("f", (1, 2, 4), jnp.inf), ("g", (), jnp.nan)]
  for leaf, index, value in bad:
    tree = dict(clean)
    tree[leaf] = tree[leaf].at[index].set(value)
    assert not bool(check(tree)), (leaf, index, value)
  # A norm past FP32's range is an overflow too (documented).
  assert not bool(check({"a": jnp.full((2,), 2e19, jnp.float32)}))


def _reductions(tx, params, grads) -> int:
  """Reductions left in the compiled update of ``tx`` (XLA:CPU)."""
  with jax.numpy_dtype_promotion("standard"):  # optax mixes dtypes
    state = tx.init(params)
    lowered = jax.jit(tx.update).lower(grads, state, params)
  text = lowered.compile().as_text()
  return sum(" reduce(" in line for line in text.splitlines())


def test_the_check_shares_the_clips_norm():
  """Under optax.clip_by_global_norm the check adds no reduction: XLA
  computes the global norm once for both (the check's compile cost)."""
  params = {"w": jnp.ones((64, 32)), "v": jnp.ones((4, 32)),
            "b": jnp.ones(32), "h": jnp.ones((32, 16), jnp.bfloat16)}
  grads = jax.tree.map(lambda p: p * 0.5, params)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  n_clip = _reductions(optax.with_extra_args_support(clipped), params, grads)
  assert n_clip >= len(params)  # one per leaf at least: the norm
  assert _reductions(ow.mixed_precision(clipped), params, grads) == n_clip
  # Without a clip, the check is the only reduction of the update.
  assert _reductions(ow.mixed_precision(optax.adam(1e-3)), params,
                     grads) == n_clip
  assert _reductions(optax.adam(1e-3), params, grads) == 0


def test_needs_master():
  f32 = jnp.float32
  assert ow.needs_master(jnp.ones(2, jnp.bfloat16), f32)
  assert ow.needs_master(jnp.ones(2, jnp.float16), f32)
  assert ow.needs_master(jnp.ones(2, jnp.float8_e4m3fn), jnp.bfloat16)
  assert ow.needs_master(nnx.Param(jnp.ones(2, jnp.bfloat16)), f32)
  assert not ow.needs_master(jnp.ones(2), f32)  # as wide: no master
  assert not ow.needs_master(jnp.ones(2), jnp.bfloat16)  # wider
  assert not ow.needs_master(jnp.arange(2), f32)  # not floating
  assert not ow.needs_master(optax.MaskedNode(), f32)


def test_find_state_finds_the_outermost():
  tx = ow.skip_if_nonfinite(ow.skip_if_nonfinite(optax.sgd(1.0)))
  p = {"w": jnp.ones(1)}
  s = tx.init(p)
  assert ow.find_state(s, ow.SkipState) is s
  assert ow.find_state(s, ow.MasterWeightsState) is None
  assert ow.find_state(s.inner_state, ow.SkipState) is s.inner_state
  # The outer skip keeps the inner state as it was: only its count moves.
  _, s = tx.update({"w": jnp.full(1, jnp.nan)}, s, p)
  assert int(ow.find_state(s, ow.SkipState).skipped) == 1
  assert int(s.inner_state.skipped) == 0


def test_master_weights_keep_the_variables_metadata():
  p = {"w": nnx.Param(jnp.ones(2, jnp.bfloat16), tag="kept"),
       "b": nnx.Param(jnp.ones(2), tag="wide")}
  s = ow.master_weights(optax.sgd(1.0)).init(p)
  master = s.master["w"]
  assert isinstance(master, nnx.Param) and master.get_metadata()["tag"] == \
      "kept"
  assert master[...].dtype == jnp.float32
  assert isinstance(s.master["b"], optax.MaskedNode)


# ==========================================================================
# The optax pieces alone, on plain arrays


def test_master_weights_trajectory():
  tx = ow.master_weights(optax.sgd(1.0))
  p = {"a": jnp.ones(1, jnp.bfloat16), "b": jnp.ones(1)}
  s = tx.init(p)
  assert isinstance(s.master["b"], optax.MaskedNode)  # FP32: no master
  g = {"a": jnp.full(1, 2.0**-10, jnp.bfloat16), "b": jnp.full(1, 0.25)}
  # The master takes every 2^-10 step; BF16 (spacing 2^-8 below 1) only
  # moves once the master is nearer 1 - 2^-8 than 1. At 1 - 2^-9 (a tie)
  # round-to-nearest-even keeps 1.0.
  masters = [1 - 2.0**-10, 1 - 2.0**-9, 1 - 3 * 2.0**-10]
  narrow = [1.0, 1.0, 1 - 2.0**-8]
  for m_want, a_want in zip(masters, narrow):
    u, s = tx.update(g, s, p)
    assert s.master["a"].dtype == jnp.float32
    assert float(s.master["a"][0]) == m_want
    assert u["a"].dtype == jnp.bfloat16 and u["b"].dtype == jnp.float32
    assert float(u["b"][0]) == -0.25  # a wide Param's update passes through
    p = optax.apply_updates(p, u)
    assert float(p["a"][0]) == a_want
  # Plain BF16 SGD never leaves 1.0: 1 - 2^-10 rounds back up every step.
  assert float(optax.apply_updates(jnp.ones(1, jnp.bfloat16),
                                   -g["a"])[0]) == 1.0


def test_master_weights_needs_params_and_a_float_dtype():
  tx = ow.master_weights(optax.sgd(1.0))
  s = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, s)
  with pytest.raises(ValueError, match="master dtype must be a floating"):
    ow.master_weights(optax.sgd(1.0), dtype=jnp.int32)


def test_cast_moments_stores_narrow_computes_wide():
  tx = ow.cast_moments(optax.sgd(1.0, momentum=0.5), jnp.bfloat16)
  p = {"w": jnp.zeros(1)}
  s = tx.init(p)
  g1 = 1 + 2.0**-10  # exact in FP32, rounds to 1.0 in BF16
  u, s = tx.update({"w": jnp.full(1, g1)}, s, p)
  # This step's update uses the FP32 trace; only the stored one is narrow.
  assert float(u["w"][0]) == -g1
  trace = s.inner_state[0].trace["w"]
  assert trace.dtype == jnp.bfloat16 and float(trace[0]) == 1.0
  u, s = tx.update({"w": jnp.zeros(1)}, s, p)
  assert float(u["w"][0]) == -0.5  # 0.5 * the stored 1.0, not 0.5 * g1
  with pytest.raises(ValueError, match="moment dtype must be a floating"):
    ow.cast_moments(optax.sgd(1.0), "int8")


def test_cast_moments_leaves_scalars_alone():
  tx = ow.cast_moments(
      optax.inject_hyperparams(optax.adam)(learning_rate=0.1), jnp.bfloat16)
  s = tx.init({"w": jnp.ones(3)})
  inner = s.inner_state
  assert inner.hyperparams["learning_rate"].dtype == jnp.float32
  assert inner.inner_state[0].count.dtype == jnp.int32
  assert inner.inner_state[0].mu["w"].dtype == jnp.bfloat16


def test_skip_if_nonfinite_trajectory():
  tx = ow.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.array([-0.0, 0.0, 1.0])}
  s = tx.init(p)
  u, s = tx.update({"w": jnp.array([1.0, 2.0, 0.0])}, s, p)
  np.testing.assert_array_equal(u["w"], [-1.0, -2.0, -0.0])
  before = s
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    u, s = tx.update({"w": jnp.array([bad, 1.0, 1.0])}, s, p)
    assert np.all(np.signbit(u["w"])) and not np.any(u["w"])  # all -0.0
    # p + (-0.0) is p bit for bit, signed zeros included.
    assert_bits_equal(optax.apply_updates(p, u), p)
    assert_bits_equal(s.inner_state, before.inner_state)
  assert int(s.skipped) == 3
  u, s = tx.update({"w": jnp.array([1.0, 0.0, 0.0])}, s, p)
  # trace = g + 0.5 * trace = [1, 0, 0] + 0.5 * [1, 2, 0]
  np.testing.assert_array_equal(u["w"], [-1.5, -1.0, -0.0])
  assert int(s.skipped) == 3


def test_skip_if_nonfinite_jitted_matches_eager():
  tx = ow.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.ones(2)}
  gs = [jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 1.0]),
        jnp.array([0.5, 0.5])]
  out = {}
  for name, update in (("eager", tx.update), ("jit", jax.jit(tx.update))):
    s, us = tx.init(p), []
    for g in gs:
      u, s = update({"w": g}, s, p)
      us.append(u)
    out[name] = (us, s)
  assert_bits_equal(out["eager"], out["jit"])


def test_skip_if_nonfinite_names_a_state_that_changes_dtype():
  # BF16 Params, FP32 gradients and no masters: the momentum would turn FP32.
  tx = ow.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"changed its state .*trace.*"
                     r"bfloat16\[2\] to float32\[2\]"):
    tx.update({"w": jnp.ones(2)}, tx.init(p), p)


def _counting(inner):
  """``inner`` with a count of its update's calls (traces, under jit)."""
  calls = []

  def update(updates, state, params=None):
    calls.append(1)
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update), calls


@pytest.mark.parametrize("update_dtype", [jnp.float32, jnp.bfloat16])
def test_skip_if_nonfinite_traces_the_step_once(update_dtype):
  """One trace of the inner update (no separate shape pass), whatever the
  updates' dtype; a skipped step's updates keep that dtype."""
  cast = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (jax.tree.map(lambda t: t.astype(update_dtype),
                                         u), s))
  inner, calls = _counting(optax.chain(optax.sgd(1.0, momentum=0.5), cast))
  tx = ow.skip_if_nonfinite(inner)
  p = {"w": jnp.ones(3)}
  s = tx.init(p)
  u, s = jax.jit(tx.update)({"w": jnp.array([1.0, 2.0, 3.0])}, s, p)
  assert len(calls) == 1
  assert u["w"].dtype == update_dtype
  np.testing.assert_array_equal(u["w"].astype(jnp.float32), [-1, -2, -3])
  u, s = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 3.0])}, s, p)
  assert u["w"].dtype == update_dtype and int(s.skipped) == 1
  assert np.all(np.signbit(u["w"].astype(jnp.float32)))


def test_skip_if_nonfinite_eager_update_compiles_nothing_new():
  """Called eagerly, the skip is a Python branch: after a first finite and
  a first skipped update, more updates compile nothing (a ``lax.cond``
  compiled a fresh ``jit(cond)`` on every call: its branches are new
  closures each time)."""
  tx = ow.skip_if_nonfinite(optax.sgd(1.0, momentum=0.5))
  p = {"w": jnp.ones(3)}
  s = tx.init(p)
  good, bad = jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0, jnp.nan, 3.0])
  for g in (good, bad):
    _, s = tx.update({"w": g}, s, p)
  with count_compiles() as compiled:
    for g in (good, bad, good):
      u, s = tx.update({"w": g}, s, p)
  assert compiled == [], compiled
  assert int(s.skipped) == 2
  # trace: [1, 2, 3], then (skipped), [1, 2, 3] + 0.5 * trace, (skipped),
  # [1, 2, 3] + 0.5 * [1.5, 3, 4.5].
  np.testing.assert_array_equal(u["w"], [-1.75, -3.5, -5.25])


def test_dynamic_loss_scaling_trajectory():
  tx = ow.dynamic_loss_scaling(optax.sgd(1.0), init_scale=4.0,
                                  growth_interval=2)
  s = tx.init({"w": jnp.zeros(1)})
  steps = [  # (scaled gradient, update, scale after, good steps after)
      (8.0, -2.0, 4.0, 1),
      (4.0, -1.0, 8.0, 0),  # 2 finite steps in a row: grown
      (jnp.inf, -jnp.inf, 4.0, 0),  # alone it does not skip, only backs off
      (8.0, -2.0, 4.0, 1),
      (jnp.nan, None, 2.0, 0),
      (jnp.inf, None, 1.0, 0),
      (jnp.inf, None, 1.0, 0),  # never below 1
  ]
  for g, want_u, want_scale, want_good in steps:
    u, s = tx.update({"w": jnp.full(1, g)}, s)
    if want_u is not None:
      assert float(u["w"][0]) == want_u
    assert float(s.loss_scale) == want_scale
    assert int(s.good_steps) == want_good
    assert s.loss_scale.dtype == jnp.float32
    assert s.good_steps.dtype == jnp.int32


def test_dynamic_loss_scaling_unscales_fp16_in_fp32():
  tx = ow.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**20)
  g = jnp.full(1, 1 + 2.0**-10, jnp.float16)  # exact in FP16
  u, _ = tx.update({"w": g}, tx.init({"w": jnp.zeros(1, jnp.float16)}))
  # (1 + 2^-10) * 2^-20 is exact in FP32; FP16 (subnormal spacing 2^-24)
  # would round it to 2^-20.
  assert u["w"].dtype == jnp.float32
  assert float(u["w"][0]) == -(1 + 2.0**-10) * 2.0**-20


@pytest.mark.parametrize("kwargs, match", [
    ({"init_scale": 0.5}, "init_scale"),
    ({"init_scale": float("inf")}, "init_scale"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 1.5}, "growth_interval"),
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
])
def test_dynamic_loss_scaling_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ow.dynamic_loss_scaling(optax.sgd(1.0), **kwargs)


def test_mixed_precision_rejects_loss_scaling_without_skipping():
  with pytest.raises(ValueError, match="needs skip_nonfinite"):
    ow.mixed_precision(optax.sgd(1.0), dynamic_loss_scale=True,
                          skip_nonfinite=False)


# ==========================================================================
# Composition


def _chain(state):
  out = []
  while hasattr(state, "inner_state"):
    out.append(type(state).__name__)
    state = state.inner_state
  return out


def test_mixed_precision_composition_order():
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  full = ow.mixed_precision(optax.adam(0.1), moment_dtype=jnp.bfloat16,
                               dynamic_loss_scale=True)
  assert _chain(full.init(p)) == ["LossScaleState", "SkipState",
                                  "MasterWeightsState", "CastMomentsState"]
  assert _chain(ow.mixed_precision(optax.adam(0.1)).init(p)) == [
      "SkipState", "MasterWeightsState"]
  assert _chain(ow.mixed_precision(
      optax.adam(0.1), master_dtype=None, skip_nonfinite=False).init(p)) == []


@pytest.mark.usefixtures("optax_promotion")
def test_masters_outside_moment_cast_stay_wide():
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  good = ow.master_weights(ow.cast_moments(optax.adam(0.1),
                                                 jnp.bfloat16))
  bad = ow.cast_moments(ow.master_weights(optax.adam(0.1)),
                           jnp.bfloat16)
  s_good, s_bad = good.init(p), bad.init(p)
  assert s_good.master["w"].dtype == jnp.float32
  assert s_good.inner_state.inner_state[0].mu["w"].dtype == jnp.bfloat16
  # The other way round the cast reaches the masters too.
  assert s_bad.inner_state.master["w"].dtype == jnp.bfloat16


def test_loss_scale_outside_skipping_backs_off_on_overflow():
  p = {"w": jnp.ones(1)}
  g = {"w": jnp.full(1, jnp.inf)}
  tx = ow.mixed_precision(optax.sgd(1.0), dynamic_loss_scale=True,
                             init_loss_scale=8.0)
  u, s = tx.update(g, tx.init(p), p)
  assert float(s.loss_scale) == 4.0 and int(s.inner_state.skipped) == 1
  assert not np.any(u["w"])
  # Skipping outside the loss scale would freeze the scale with the rest.
  swapped = ow.skip_if_nonfinite(ow.dynamic_loss_scaling(
      optax.sgd(1.0), init_scale=8.0))
  _, s = swapped.update(g, swapped.init(p), p)
  assert float(s.inner_state.loss_scale) == 8.0 and int(s.skipped) == 1


def test_mixed_precision_trajectory():
  """Everything on (dynamic loss scale, skipping, FP32 masters of a BF16
  Param, BF16 moments) around SGD with momentum, by hand."""
  tx = ow.mixed_precision(optax.sgd(0.5, momentum=0.5),
                          moment_dtype=jnp.bfloat16, dynamic_loss_scale=True,
                          init_loss_scale=4.0, growth_interval=2)
  p = {"w": jnp.ones(1, jnp.bfloat16)}
  s = tx.init(p)
  # (scaled gradient, master, stored trace, scale, skipped) after each step.
  steps = [
      (1.0, 0.875, 0.25, 4.0, 0),  # g = 1/4: trace 0.25, master -= 0.125
      (4.0, 0.3125, 1.125, 8.0, 0),  # g = 1: trace 1.125; 2 good: grown
      (jnp.inf, 0.3125, 1.125, 4.0, 1),  # skipped; the scale backs off
      # g = 0.50390625: trace 1.06640625 (the update uses it), stored in
      # BF16 as 1.0625 (a tie to even).
      (2.015625, 0.3125 - 0.533203125, 1.0625, 4.0, 1),
      # g = 0: trace 0.5 * the stored 1.0625; 2 good steps: grown.
      (0.0, 0.3125 - 0.533203125 - 0.265625, 0.53125, 8.0, 1),
  ]
  for g, master, trace, scale, skipped in steps:
    u, s = tx.update({"w": jnp.full(1, g, jnp.bfloat16)}, s, p)
    mw = ow.find_state(s, ow.MasterWeightsState)
    assert float(mw.master["w"][0]) == master and mw.master["w"].dtype == \
        jnp.float32
    stored = ow.find_state(s, ow.CastMomentsState).inner_state[0].trace["w"]
    assert stored.dtype == jnp.bfloat16 and float(stored[0]) == trace
    assert float(ow.find_state(s, ow.LossScaleState).loss_scale) == scale
    assert int(ow.find_state(s, ow.SkipState).skipped) == skipped
    # The update is the rounded master minus the Param (p + u rounds once
    # more, so the Param is written from the master, as Optimizer does).
    narrow = mw.master["w"].astype(jnp.bfloat16)
    assert u["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(u["w"], narrow - p["w"])  # -0.0 if skipped
    p = {"w": narrow}


def test_mixed_precision_passes_extra_args_through():
  """``inner``'s extra keyword arguments reach it through every wrapper."""
  def update(updates, state, params=None, *, factor):
    return jax.tree.map(lambda g: -factor * g, updates), state

  inner = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update)
  tx = ow.mixed_precision(inner, moment_dtype=jnp.bfloat16,
                          dynamic_loss_scale=True, init_loss_scale=2.0)
  p = {"a": jnp.ones(1, jnp.bfloat16), "b": jnp.ones(1)}
  s = tx.init(p)
  u, s = tx.update({"a": jnp.full(1, 2.0, jnp.bfloat16),
                    "b": jnp.full(1, 6.0)}, s, p, factor=0.25)
  # Unscaled by 2, times -0.25: a's master 1 - 0.25, b's update -0.75.
  assert float(ow.find_state(s, ow.MasterWeightsState).master["a"][0]) == 0.75
  assert float(u["b"][0]) == -0.75 and float(u["a"][0]) == -0.25


def test_loss_scale_stops_growing_at_its_cap():
  # Uncapped, it grew to 2**127 (whose reciprocal flushes to 0: zero updates
  # counted as good steps), then to Inf, where every step was skipped.
  tx = ow.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**62,
                               growth_interval=1)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  g = {"w": jnp.full(3, 1e-3)}
  for _ in range(4):
    u, state = tx.update(jax.tree.map(lambda a: a * state.loss_scale, g),
                         state, params)
    np.testing.assert_allclose(u["w"], -1e-3, rtol=1e-6)
  assert float(state.loss_scale) == 2.0**64
  with pytest.raises(ValueError, match="init_scale"):
    ow.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**65)
  # A scale of 3000 in a BF16 loss is 3008, unscaled by 1 / 3000: every
  # update 0.27% off. Scales and factors are powers of two.
  for bad in (dict(init_scale=3000.0), dict(growth_factor=1.5),
              dict(backoff_factor=0.75)):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a "
                       "power of two"):
      ow.dynamic_loss_scaling(optax.sgd(1.0), **bad)


def test_loss_scaling_without_masters_refuses_narrow_params():
  tx = ow.mixed_precision(optax.adam(1e-3), master_dtype=None,
                          dynamic_loss_scale=True)
  with pytest.raises(ValueError, match="master_dtype=jnp.float32"):
    tx.init({"w": jnp.ones(4, jnp.float16)})
  tx.init({"w": jnp.ones(4)})  # FP32 Params need no masters


def test_float16_moments_are_refused():
  # Adam's second moment of 1e-4 gradients (1e-8) underflows in float16:
  # its updates were 73% off after three steps.
  with pytest.raises(ValueError, match="bfloat16"):
    ow.cast_moments(optax.adam(1e-3), jnp.float16)
  ow.cast_moments(optax.adam(1e-3), jnp.bfloat16)
