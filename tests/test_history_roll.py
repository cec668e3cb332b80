"""The end of a delayed-scaling step as one kernel per GEMM
(qlayers.history_roll), run in Pallas' interpreter on CPU."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers import delayed
from qlayers import history_roll
from qlayers import table
from qlayers.delayed import ScaleState

_NAN, _INF = float("nan"), float("inf")


def _xla(st, update):
  if update is not None:
    st = st._replace(amax=delayed.merge_amax(st.amax, update))
  return delayed.update_scales(st)


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("length", [1, 4, 1024])
def test_roll_is_merge_then_update_scales_bit_for_bit(length):
  """Every role of the call rolls its own history, with its own running
  amax (non-finite: recorded as 0) and update (NaN/Inf: no information;
  BF16: widened), as `merge_amax` then `update_scales` do."""
  key = jax.random.key(0)
  cases = [(3.0, None), (_INF, None), (_NAN, None), (0.0, 5.0),
           (7.0, 2.0), (1.0, _NAN), (2.0, -_INF), (_NAN, 4.0),
           (1.5, jnp.bfloat16(2.5))]
  states, updates = [], []
  for i, (amax, update) in enumerate(cases):
    history = jax.random.uniform(jax.random.fold_in(key, i), (length,),
                                 jnp.float32, 0.0, 100.0)
    states.append(ScaleState(history, jnp.float32(amax)))
    updates.append(None if update is None else jnp.asarray(update))
  got = history_roll.roll(states, updates, interpret=True)
  for st, update, new in zip(states, updates, got, strict=True):
    want = _xla(st, update)
    assert new.amax_history.shape == want.amax_history.shape == (length,)
    np.testing.assert_array_equal(_bits(new.amax_history),
                                  _bits(want.amax_history))
    assert new.amax.shape == () and new.amax.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(new.amax), _bits(want.amax))
  # A step the optimizer skipped: every history records 0 for it.
  for applied in (True, False):
    got = history_roll.roll(states, updates, jnp.asarray(applied),
                            interpret=True)
    want = history_roll.end_step(states, updates, applied)  # XLA's ops
    for new, ref, st in zip(got, want, states, strict=True):
      np.testing.assert_array_equal(_bits(new.amax_history),
                                    _bits(ref.amax_history))
      if not applied:
        np.testing.assert_array_equal(
            new.amax_history, jnp.concatenate([jnp.zeros(1),
                                               st.amax_history[:-1]]))


def test_roll_refuses_what_it_cannot_take():
  ok = delayed.init_scale_state(8)
  assert history_roll.supported([ok, ok])
  for bad in (delayed.init_scale_state(6),  # not a power of two
              delayed.init_scale_state(8, batch_shape=(2,))):  # stacked
    assert not history_roll.supported([ok, bad])
    with pytest.raises(ValueError, match="power of two"):
      history_roll.roll([ok, bad], interpret=True)
  assert not history_roll.supported([])


def _gpu_branch(monkeypatch):
  """`end_step` taking its CUDA branch, the kernel interpreted."""
  def cuda_branch(*args, cuda, **_):
    return cuda(*args)

  roll = history_roll.roll
  monkeypatch.setattr(history_roll, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent": cuda_branch}))
  calls = []

  def interpreted(*args, **kw):
    calls.append(len(args[0]))
    return roll(*args, interpret=True, **kw)

  monkeypatch.setattr(history_roll, "roll", interpreted)
  jax.clear_caches()  # `end_step`'s cached traces: traced anew, patched
  return calls


def test_update_scales_on_a_gpu_target_keeps_the_state_bit_for_bit(
    monkeypatch):
  """A model's step ended through the kernel (one per GEMM, its three
  roles) leaves every history, running amax and gradient amax as XLA's ops
  do; stacked layers (nnx.vmap) keep XLA's ops."""
  def model():
    return nnx.Sequential(qlayers.QuantDense(64, 128, rngs=nnx.Rngs(0)),
                          qlayers.QuantDense(128, 64, rngs=nnx.Rngs(1)))

  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
  x = jax.random.normal(jax.random.key(2), (4, 64))

  def loss(m, x):
    return jnp.mean(m(x) ** 2)

  def end(m):
    for _ in range(2):  # a second step: histories not empty
      _, grads = nnx.value_and_grad(loss, argnums=diff)(m, x)
      assert qlayers.update_scales(m, grads) == 2
    return nnx.state(m, qlayers.QuantVariable)

  want = end(model())
  calls = _gpu_branch(monkeypatch)
  with table.target_arch("sm_90"):
    got = end(model())
  # Traced once, its three roles: both GEMMs' ends of step, both steps,
  # have one signature and so one cached trace (`end_step`).
  assert calls == [3]
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert float(jnp.max(got["layers"][1]["quant"]["g_amax_history"][...])) > 0


def test_update_scales_lowers_to_one_kernel_per_gemm_for_cuda():
  m = nnx.Sequential(qlayers.QuantDense(64, 64, rngs=nnx.Rngs(0)),
                     qlayers.QuantDense(64, 64, rngs=nnx.Rngs(1)))
  graph, state = nnx.split(m)

  def end(state):
    m = nnx.merge(graph, state)
    qlayers.update_scales(m)
    return nnx.state(m)

  with table.target_arch("sm_100"):
    cuda = jax.jit(end).trace(state).lower(
        lowering_platforms=("cuda",)).as_text()
  cpu = jax.jit(end).trace(state).lower().as_text()
  assert cuda.count("qlayers_history_roll") == 2
  assert "qlayers_history_roll" not in cpu


def test_update_scales_refuses_grads_of_another_model():
  a = qlayers.QuantDense(64, 64, rngs=nnx.Rngs(0))
  b = nnx.Sequential(qlayers.QuantDense(64, 64, rngs=nnx.Rngs(1)))
  diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
  _, grads = nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2),
                                argnums=diff)(b, jnp.ones((2, 64)))
  before = nnx.state(a, qlayers.QuantVariable)
  with pytest.raises(ValueError, match="paths the model has none at"):
    qlayers.update_scales(a, grads)
  for x, y in zip(jax.tree.leaves(before),
                  jax.tree.leaves(nnx.state(a, qlayers.QuantVariable))):
    np.testing.assert_array_equal(x, y)  # nothing written


def test_the_kernel_runs_under_a_mesh_where_the_casts_read_the_histories():
  """Under an auto-axes mesh the roll is the kernel, as the per-tensor cast
  kernel that reads the histories runs there too (Hopper and Blackwell);
  under explicit axes the kernel has no sharding rule: XLA's ops."""
  from jax.sharding import AbstractMesh, AxisType  # pylint: disable=g-import-not-at-top
  auto = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
  explicit = AbstractMesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  under = history_roll._under_mesh  # pylint: disable=protected-access
  for arch in ("sm_90", "sm_100"):
    with table.target_arch(arch):
      assert under(auto) and not under(explicit), arch
