"""Delayed scaling (qlayers.delayed): history, running amax, end of step."""

import jax.numpy as jnp
import numpy as np
import pytest

from qlayers import delayed as S


def test_delayed_scaling_hand_computed_trajectory():
  """History of 3, algo max: spike, NaN step, spike leaving the window."""
  st = S.init_scale_state(3)
  amaxes = [2.0, 4.0, 44.8, np.nan, 1.0, 1.0, 1.0]
  used, hists = [], []
  for a in amaxes:
    now, running = S.delayed_amax(st, jnp.float32(a))
    used.append(float(now))
    st = S.update_scales(st._replace(amax=running))
    hists.append(np.asarray(st.amax_history).tolist())
  # Step 0 uses the current amax (empty history), later steps the stored
  # ones; the NaN step scales by NaN (its GEMM is non-finite) but records 0.
  np.testing.assert_allclose(
      used, [2, 2, 4, np.nan, 44.8, 44.8, 1], rtol=1e-6)
  assert hists == [[2, 0, 0], [4, 2, 0], [np.float32(44.8), 4, 2],
                   [0, np.float32(44.8), 4], [1, 0, np.float32(44.8)],
                   [1, 1, 0], [1, 1, 1]]


def test_delayed_running_amax_combines_uses_by_max():
  st = S.init_scale_state(4)
  for a in (3.0, 5.0, np.inf, 4.0):
    now, running = S.delayed_amax(st, jnp.float32(a))
    st = st._replace(amax=running)
  assert float(st.amax) == 5.0  # Inf never enters
  # Within the first step every use scales by the running max so far.
  assert float(now) == 5.0


def test_history_amax_max_and_most_recent():
  hist = jnp.array([2.0, 100.0, 50.0])
  assert float(S.history_amax(hist, "most_recent")) == 2.0
  assert float(S.history_amax(hist, "max")) == 100.0
  # most_recent skips steps that recorded nothing (0), as TE keeps the
  # previous scale then.
  assert float(S.history_amax(jnp.array([0.0, 7.0, 9.0]), "most_recent")) == 7
  assert float(S.history_amax(jnp.zeros(3), "most_recent")) == 0.0
  with pytest.raises(ValueError, match="amax_compute_algo"):
    S.history_amax(hist, "mean")


def test_nan_never_poisons_history():
  st = S.ScaleState(jnp.array([3.0, 0.0]), jnp.float32(0))
  for bad in (np.nan, np.inf):
    now, running = S.delayed_amax(st, jnp.float32(bad))
    assert not np.isfinite(float(now))  # this use's GEMM is non-finite
    assert float(running) == 0.0
    nxt = S.update_scales(st._replace(amax=jnp.float32(bad)))
    assert np.asarray(nxt.amax_history).tolist() == [0.0, 3.0]
    # The next step scales by the stored 3 again.
    assert float(S.delayed_amax(nxt, jnp.float32(1.0))[0]) == 3.0


def test_stacked_state_updates_per_layer():
  st = S.init_scale_state(2, batch_shape=(3,))
  st = st._replace(amax=jnp.array([1.0, 2.0, jnp.nan]))
  nxt = S.update_scales(st)
  np.testing.assert_array_equal(nxt.amax_history, [[1, 0], [2, 0], [0, 0]])
  np.testing.assert_array_equal(nxt.amax, [0, 0, 0])
