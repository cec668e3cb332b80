"""Inf/NaN in any GEMM operand reaches the GEMM result, for every recipe's path.

A non-finite element of x, w or the output gradient g makes every output
that depends on it non-finite, in Fprop, Dgrad and Wgrad, so a training step
can detect it and skip (never a silently finite value: a saturating cast
would clip Inf to the format's max, about 60 in the output)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
from qlayers import ops

M, K, N = 64, 128, 96
# (row, col) of the bad element in x (M, K), w (K, N) and g (M, N).
AT_X, AT_W, AT_G = (5, 17), (40, 70), (50, 11)


@functools.cache
def _step(name):
  recipe = qlayers.recipe(name)

  def run(x, w, g, state):
    def f(x, w, state):  # the state too, as a training step differentiates it
      return ops.quantized_matmul(x, w, recipe, state)[0]
    y, vjp = jax.vjp(f, x, w, state)
    dx, dw, _ = vjp(g.astype(y.dtype))
    return y, dx, dw
  return jax.jit(run)


def _data(kinds):
  keys = jax.random.split(jax.random.key(0), 3)
  x = np.array(jax.random.normal(keys[0], (M, K)))
  w = np.array(jax.random.normal(keys[1], (K, N))) * 0.1
  g = np.array(jax.random.normal(keys[2], (M, N)))
  vals = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
  for t, at, kind in zip((x, w, g), (AT_X, AT_W, AT_G), kinds):
    if kind:
      t[at] = vals[kind]
  return x, w, g


def _state(name, history):
  state = ops.init_state(name)
  if state is not None and history:
    state = {r: st._replace(amax_history=st.amax_history.at[0].set(3.0))
             for r, st in state.items()}
  return state


def _nonfinite(a):
  return ~np.isfinite(np.asarray(a, np.float32))


# Scale units are local in these: outputs of units without the bad element
# stay finite (per-tensor recipes make the whole GEMM non-finite instead).
FINE_GRAINED = ("fp8_rowwise", "deepseek_v3", "mxfp8")


# Recipes made of paths others take here: deepseek_v3_ue8m0 is deepseek_v3's
# tiles and blocks with fp8_rowwise's power-of-two scales; mxfp4_mlperf is
# mxfp4's E2M1 blocks rounded to nearest, with mxfp4_rht's Hadamard of the
# gradient GEMMs' operands (nvfp4's Wgrad has its 16-point size).
COVERED = {"deepseek_v3_ue8m0": ("deepseek_v3", "fp8_rowwise"),
           "mxfp4_mlperf": ("mxfp4", "mxfp4_rht", "nvfp4")}


@pytest.mark.parametrize("name", [n for n in qlayers.available_recipes()
                                  if n not in COVERED])
def test_nonfinite_operands_reach_every_dependent_output(name):
  """Also, with the same compiled step: clean operands give finite outputs,
  and a fine-grained recipe keeps the outputs of other units finite."""
  step = _step(name)
  x, w, g = _data((None, None, None))
  outs = step(x, w, g, _state(name, False))
  assert not any(_nonfinite(o).any() for o in outs), name
  if name in FINE_GRAINED:
    x, w, g = _data(("nan", None, None))
    y, _, _ = map(_nonfinite, step(x, w, g, _state(name, False)))
    assert y[AT_X[0], :].all()
    assert not y[AT_X[0] + 1:, :].any()
  histories = (False, True) if qlayers.recipe(name).delayed else (False,)
  for history in histories:  # delayed: empty history, and a stored scale
    for kinds in (("nan", "inf", "-inf"), ("inf", "nan", "nan")):
      x, w, g = _data(kinds)
      y, dx, dw = map(_nonfinite, step(x, w, g, _state(name, history)))
      (i1, k1), (k2, j2), (i3, j3) = AT_X, AT_W, AT_G
      where = f"{name}, {kinds}, stored history {history}"
      assert y[i1, :].all() and y[:, j2].all(), f"Fprop: {where}"
      assert dx[i3, :].all() and dx[:, k2].all(), f"Dgrad: {where}"
      assert dw[k1, :].all() and dw[:, j3].all(), f"Wgrad: {where}"
