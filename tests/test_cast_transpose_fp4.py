"""The 4-bit cast kernels (qlayers/cast_transpose/fp4.py, nvfp4.py) and their
E2M1 words (_e2m1.py): MXFP4 and NVFP4 copies of a tensor and its
transpose, and the matmuls that run them."""

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
import qlayers.scaling
from qlayers import cast_transpose as ct
from qlayers.cast_transpose import _e2m1
from qlayers.cast_transpose import _lanes
from qlayers import formats
from qlayers import hadamard
from qlayers import ops
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.operands import operand, operand_pair
from _support import cast_kernels as ck


@pytest.mark.parametrize("hadamard", [(16, 32), (0, 32)])
def test_fp4_copies_of_transforms_are_quantize_bit_for_bit(hadamard):
  """With Hadamard transforms (the gradient GEMMs of `mxfp4_rht`,
  `mxfp4_mlperf`): each copy is `scaling.quantize` of its own transform,
  of t along its columns and of t.T along t's rows, rounded to nearest and
  stochastically."""
  t = ck.data((64, 96), jnp.bfloat16).at[0, 0].set(1.0)
  spec = qlayers.scaling.QuantSpec(format="e2m1", granularity="mx")
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  srcs = [ck.transform(t, size, axis) if size else t
          for size, axis in zip(hadamard, (1, 0))]
  for k in (None, keys):
    got = ct.fp4_cast_transpose(t, keys=k, hadamard=hadamard, interpret=True)
    rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=kk) for a, kk in
                  zip((srcs[0], srcs[1].T), k or (None, None)))
    for g, w in zip(got, (rows.payload, rows.scale, cols.payload,
                          cols.scale)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="hadamard takes two sizes"):
    ct.fp4_cast_transpose(t, hadamard=(64, 0), interpret=True)


# Each dtype (the load) and each rule (the scale) once.
@pytest.mark.parametrize("dtype,rule", [(jnp.bfloat16, "mx_rceil"),
                                        (jnp.float32, "mx_floor")])
def test_fp4_copies_are_quantize_of_t_and_t_transposed_bit_for_bit(dtype,
                                                                   rule):
  # Scaled values on every E2M1 rounding tie and between them, a zero row,
  # a block under the FP32 normal range, NaN and Inf blocks.
  t = ck.data((64, 96), dtype).at[9, :].set(0.0).at[40, 70].set(1e-30)
  # (a block whose amax is 6: scale 1, so its elements are their values)
  ties = jnp.zeros(32).at[:25].set(jnp.arange(0.0, 6.25, 0.25)).astype(dtype)
  t = t.at[16, 32:64].set(ties).at[32:64, 64].set(-ties)
  spec = qlayers.scaling.QuantSpec(format="e2m1", granularity="mx",
                                   scale_rule=rule)
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  nearest = None
  for k in (None, keys):
    q, s, qt, st = ct.fp4_cast_transpose(t, rule, keys=k, interpret=True)
    rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=kk) for a, kk in
                  zip((t, t.T), k or (None, None)))
    for got, want in ((q, rows.payload), (s, rows.scale),
                      (qt, cols.payload), (st, cols.scale)):
      assert got.dtype == want.dtype == jnp.uint8
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(s[0, 0]) == 255 and int(st[0, 0]) == 255  # the NaN's blocks
    if nearest is None:
      nearest = q
  assert (np.asarray(q) != np.asarray(nearest)).mean() > 0.2  # it rounded
  with pytest.raises(ValueError, match="multiples of 32"):
    ct.fp4_cast_transpose(t[:48], rule, interpret=True)
  with pytest.raises(ValueError, match="one PRNG key per copy"):
    ct.fp4_cast_transpose(t, rule, keys=keys[:1], interpret=True)


def test_fp4_pair_for_blackwell_is_operand_and_its_transposed_copy():
  t = ck.data((2, 32, 96), jnp.bfloat16)
  spec = ck.spec("mxfp4")
  last_op, first_op = Operand(spec, 1), Operand(spec, 0, True)
  want = (operand(t, last_op), operand(t, first_op))
  with table.target_arch("sm_100"):
    assert qlayers.operands.pairable(t, last_op, first_op)
    got = operand_pair(t, last_op, first_op)
    cuda = jax.jit(lambda t: operand_pair(t, last_op, first_op)).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
    sr = dataclasses.replace(spec, rounding="stochastic")
    sr_ops = (Operand(sr, 1), Operand(sr, 0, True))
    assert qlayers.operands.pairable(t, *sr_ops)
    keys = (jax.random.key(1), jax.random.key(2))
    sr_got = operand_pair(t, *sr_ops, keys=keys)
    sr_fp8 = dataclasses.replace(ck.spec("mxfp8"), rounding="stochastic")
    assert not qlayers.operands.pairable(t, Operand(sr_fp8, 1),
                                         Operand(sr_fp8, 0))
  sr_want = [operand(t, op, key=k) for op, k in zip(sr_ops, keys)]
  for g, w in zip(sr_got, sr_want):
    np.testing.assert_array_equal(np.asarray(g.payload), np.asarray(w.payload))
  for g, w in zip(got, want):
    assert (g.axis, g.block, g.shape, g.transposed) == (
        w.axis, w.block, w.shape, w.transposed)
    np.testing.assert_array_equal(np.asarray(g.payload), np.asarray(w.payload))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))
  assert "qlayers_fp4_cast_transpose" in cuda


def _nvfp4_spec(granularity="tile"):
  return qlayers.scaling.QuantSpec(format="e2m1", granularity=granularity,
                                   scale_rule="nvfp4")


def _nvfp4_data(dtype):
  # Scaled values on E2M1 ties and between them, a zero row, a block far
  # under the tensor's amax (its E4M3 scale underflows to 0), tiny values.
  t = jax.random.normal(jax.random.key(4), (64, 96), jnp.float32) * 30.0
  t = t.at[9, :].set(0.0).at[40, 16:32].set(1e-6).at[17, 70].set(-2e-30)
  ties = jnp.arange(0.0, 4.0, 0.25)
  return t.at[16, 32:48].set(ties).at[48:64, 64].set(-ties).astype(dtype)


# Each dtype (the load) and each layout of the transform once.
@pytest.mark.parametrize("dtype,hadamard", [(jnp.float32, False),
                                            (jnp.bfloat16, True)])
def test_nvfp4_copies_are_quantize_of_t_and_t_transposed_bit_for_bit(
    dtype, hadamard):
  """Both 1 x 16 copies, payloads and E4M3 scales, equal
  `scaling.quantize` of ``t`` and of ``t.T`` (of its 16-point transform if
  ``hadamard``), rounded to nearest and stochastically; a non-finite
  element makes its own block's scale NaN, and a non-finite tensor amax
  every block's."""
  spec = _nvfp4_spec()
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(1)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(1)))
  t = _nvfp4_data(dtype)
  src = ck.transform(t, 16, 0) if hadamard else t
  inf = t.at[3, 7].set(jnp.inf)
  for amaxes in ((None, None), (jnp.float32(500.0), jnp.float32(90.0)),
                 (jnp.float32(jnp.inf), jnp.float32(jnp.nan))):
    nearest = None
    for k in (None, keys):
      q, s, qt, st = ct.nvfp4_cast_transpose(t, *amaxes, hadamard=hadamard,
                                             keys=k, interpret=True)
      rows, cols = (qlayers.scaling.quantize(a, spec, 1, amax=am, key=kk)
                    for a, am, kk in zip((t, src.T), amaxes, k or (None,) * 2))
      for got, want in ((q, rows.payload), (s, rows.block_scale),
                        (qt, cols.payload), (st, cols.block_scale)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
      nearest = q if nearest is None else nearest
    if amaxes[0] is None or np.isfinite(amaxes[0]):  # else NaN payloads
      assert (np.asarray(q) != np.asarray(nearest)).mean() > 0.1  # it rounded
  assert np.isnan(np.asarray(s, np.float32)).all()  # Inf tensor amax
  for data in (t, inf, t.at[60, 90].set(jnp.nan)):
    got = ct.nvfp4_amaxes(data, interpret=True)
    want = (qlayers.blocks.amax(data),
            qlayers.blocks.amax(ck.transform(data, 16, 0)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q, s, qt, st = ct.nvfp4_cast_transpose(inf, hadamard=hadamard,
                                         interpret=True)
  assert np.isnan(np.asarray(s, np.float32)).all()  # the amax is Inf
  q, s, _, _ = ct.nvfp4_cast_transpose(inf, jnp.float32(100.0),
                                       jnp.float32(100.0), interpret=True)
  nan = np.isnan(np.asarray(s, np.float32))
  assert nan[3, 0] and nan.sum() == 1  # only the Inf's block


def test_nvfp4_copies_of_dims_not_multiples_of_32_take_tiles_of_16():
  """A tensor whose dims are multiples of 16 but not of 32 runs the NVFP4
  kernels on 16-row, 16-column tiles: the same amaxes, the same copies,
  1 x 16 (stochastic and transformed) and in 16 x 16 blocks."""
  spec = _nvfp4_spec()
  keys = (formats.rounding_key(jnp.uint32(5), jnp.uint32(2)),
          formats.rounding_key(jnp.uint32(6), jnp.uint32(2)))
  t = _nvfp4_data(jnp.bfloat16)[:48, :80]
  for data in (t, t[:32]):  # 16-row tiles; 32-row tiles, 16-column ones
    got = ct.nvfp4_amaxes(data, interpret=True)
    want = (qlayers.blocks.amax(data),
            qlayers.blocks.amax(ck.transform(data, 16, 0)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q, s, qt, st = ct.nvfp4_cast_transpose(t, hadamard=True, keys=keys,
                                         interpret=True)
  rows, cols = (qlayers.scaling.quantize(a, spec, 1, key=k)
                for a, k in zip((t, ck.transform(t, 16, 0).T), keys))
  for got, want in ((q, rows.payload), (s, rows.block_scale),
                    (qt, cols.payload), (st, cols.block_scale)):
    np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
  square = _nvfp4_spec("block")
  got = ct.nvfp4_cast_transpose(t, square=True, interpret=True)
  for a, (q, s) in zip((t, t.T), (got[:2], got[2:])):
    want = qlayers.scaling.quantize(a, square, 1)
    np.testing.assert_array_equal(ck.bits(q), ck.bits(want.payload))
    np.testing.assert_array_equal(ck.bits(s), ck.bits(want.block_scale))


def test_nvfp4_square_blocks_are_one_quantize_in_both_layouts():
  spec = _nvfp4_spec("block")
  t = _nvfp4_data(jnp.float32)
  q, s, qt, st = ct.nvfp4_cast_transpose(t, square=True, interpret=True)
  for got, want in zip((q, s, qt, st), (
      *(lambda a: (a.payload, a.block_scale))(
          qlayers.scaling.quantize(t, spec, 1)),
      *(lambda a: (a.payload, a.block_scale))(
          qlayers.scaling.quantize(t.T, spec, 1)))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
  with pytest.raises(ValueError, match="multiples of 16"):
    ct.nvfp4_cast_transpose(t[:40], interpret=True)
  with pytest.raises(ValueError, match="square blocks"):
    ct.nvfp4_cast_transpose(t, square=True, hadamard=True, interpret=True)
  with pytest.raises(ValueError, match="one PRNG key per copy"):
    ct.nvfp4_cast_transpose(t, keys=(jax.random.key(0),), interpret=True)


def test_nvfp4_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch):
  """nvfp4 traced for Blackwell with the pair kernels run in Pallas'
  interpreter on CPU: x (transformed Wgrad copy), w (16 x 16 blocks) and g
  (stochastic, transformed) each take one kernel, and the output and
  gradients keep the bits of the unpaired matmul; the lowering for CUDA
  holds the three kernels."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1
  recipe = qlayers.recipe("nvfp4")
  state = ops.init_state(recipe)

  def loss(x, w, state):  # g's rounding keys from the call's key, as layers
    y, new_state = ops.quantized_matmul(x, w, recipe, state,
                                        key=jax.random.key(3))
    return jnp.sum(y * jnp.cos(y)), new_state

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  want = jax.jit(grad)(x, w, state)  # one compile, not one per op
  with table.target_arch("sm_100"):
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  # x and g: both amaxes in one kernel, then the pair; w: the pair.
  kernels = re.findall(r'name = "(qlayers_\w+)"', text)
  assert sorted(kernels) == ["qlayers_nvfp4_amaxes"] * 2 + [
      "qlayers_nvfp4_cast_transpose"] * 3

  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  calls, kernel = [], ct.nvfp4_cast_transpose

  def interpreted(*args, **kw):
    calls.append((kw["square"], kw["hadamard"], kw["keys"] is not None))
    return kernel(*args, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, "nvfp4_cast_transpose",
                      interpreted)
  monkeypatch.setattr(qlayers.operands.cast_transpose, "nvfp4_amaxes",
                      functools.partial(ct.nvfp4_amaxes, interpret=True))
  jax.clear_caches()  # the GEMMs' cached traces: traced anew, patched
  with table.target_arch("sm_100"):
    got = jax.jit(lambda *a: grad(*a))(x, w, state)
  assert calls == [(False, True, False), (True, False, False),
                   (False, True, True)]  # x, w, then g
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_words_hold_eight_codes_low_nibble_first():
  """The 4-bit kernels' words: a row's elements apart (`_lanes.split_last`),
  eight to a word, element ``8i + j`` in bits ``4j``, so their bytes are
  the packed payload."""
  x = jax.random.normal(jax.random.key(4), (4, 64), jnp.float32) * 4
  parts = _lanes.split_last(x)
  for j, part in enumerate(parts):
    np.testing.assert_array_equal(part, x[:, j])
  words = _lanes.join_last([_e2m1.e2m1_word(parts[k:k + 8])
                            for k in range(0, 64, 8)])
  codes = np.asarray(formats.cast(x, "e2m1"))
  got = _lanes.words_to_bytes(words)
  np.testing.assert_array_equal(got, codes[:, 0::2] | (codes[:, 1::2] << 4))
