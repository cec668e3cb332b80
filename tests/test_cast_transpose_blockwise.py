"""The block-scaled cast kernels (qlayers/cast_transpose/blockwise.py): MX
copies along each axis, DeepSeek-V3's tiles and square blocks, and the
matmuls that run them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
import qlayers.scaling
from qlayers import cast_transpose as ct
from qlayers import formats
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.operands import operand, operand_pair
from _support import cast_kernels as ck


# Each format and each rule once: the rule sets the scale, the format the
# cast, apart in the kernel.
@pytest.mark.parametrize("fmt, rule", [("e4m3", "mx_rceil"),
                                       ("e5m2", "mx_floor")])
def test_mx_copies_are_quantize_along_each_axis_bit_for_bit(fmt, rule):
  t = ck.data((96, 160), jnp.bfloat16).at[40, 70].set(1e-30)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx",
                                   scale_rule=rule)
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, rule, interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  np.testing.assert_array_equal(ck.bits(q), ck.bits(rows.payload))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(ck.bits(qt), ck.bits(cols.payload).T)
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert int(s[0, 0]) == 255  # the NaN's block


@pytest.mark.parametrize("fmt,dtype,rule", [
    ("e2m3", jnp.bfloat16, "mx_rceil"), ("e3m2", jnp.float32, "mx_floor")])
def test_mxfp6_copies_are_widened_quantize_of_t_and_t_transposed(fmt, rule,
                                                                 dtype):
  """MXFP6's copies as E4M3 payloads: the values of `scaling.widened` of
  the quantized rows of t and of t.T, bit for bit (the NaN block's zeros,
  saturation past the format's max, values rounding to zero)."""
  t = ck.data((96, 160), dtype).at[40, 70].set(1e-30)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx",
                                   scale_rule=rule)
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, rule, interpret=True)
  rows, cols = (qlayers.scaling.widened(qlayers.scaling.quantize(a, spec, 1))
                for a in (t, t.T))
  assert q.dtype == qt.dtype == rows.payload.dtype == jnp.float8_e4m3fn
  for got, want in ((q, rows.payload), (s, rows.scale), (qt, cols.payload),
                    (st, cols.scale)):
    np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
  assert int(s[0, 0]) == 255 and not np.asarray(q[0, :32], np.float32).any()
  # Every payload value is on the FP6 grid (an E4M3 value off it would be
  # another number to the GEMM).
  grid = formats.round_to_format(np.asarray(q, np.float32), fmt)
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(grid))
  with pytest.raises(ValueError, match="MX scale rule"):
    ct.mx_cast_transpose(t, fmt, "deepseek", interpret=True)
  with pytest.raises(ValueError, match="blocks of 32"):
    ct.mx_cast_transpose(t, fmt, rule, block_size=128, interpret=True)


@pytest.mark.parametrize("recipe,rule", [
    ("deepseek_v3_ue8m0", "deepseek_pow2"), ("deepseek_v3", "deepseek")])
def test_deepseek_tiles_are_quantize_along_each_axis_bit_for_bit(recipe,
                                                                  rule):
  """DeepSeek-V3 1 x 128 tiles, both ways, with power-of-two scales and
  with correctly rounded ones (max(amax, 1e-4) / 448, its reciprocal the
  multiplier): NaN and Inf tiles, tiles under the 1e-4 amax floor, amaxes
  at 448 * 2**k and just above it (where rounding up to the power of two is
  decided)."""
  spec = qlayers.recipe(recipe).fprop.lhs
  t = ck.data((256, 384), jnp.bfloat16).at[200:, :128].set(1e-9)
  t = t.at[130, 200].set(448.0 * 4).at[131, 300].set(448.0 * 4 * 1.0078125)
  q, s, qt, st = ct.mx_cast_transpose(t, spec.fmt, rule,
                                      block_size=128, interpret=True)
  rows, cols = (qlayers.scaling.quantize(t, spec, a) for a in (1, 0))
  np.testing.assert_array_equal(ck.bits(q), ck.bits(rows.payload))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rows.scale))
  np.testing.assert_array_equal(ck.bits(qt), ck.bits(cols.payload).T)
  np.testing.assert_array_equal(np.asarray(st), np.asarray(cols.scale).T)
  assert np.isnan(np.asarray(s[0, 0])) and s.dtype == jnp.float32


@pytest.mark.parametrize("recipe,arch", [("deepseek_v3_ue8m0", "sm_100"),
                                         ("deepseek_v3", "sm_90")])
def test_square_blocks_in_both_layouts_are_one_quantize(recipe, arch):
  spec = qlayers.recipe(recipe).fprop.rhs
  w = (jax.random.normal(jax.random.key(4), (256, 384)) * 0.02)
  w = w.at[0, 0].set(jnp.nan).at[128:, 128:256].set(1e-9)
  q, s, qt = ct.block_cast_transpose(w, spec.fmt, pow2=spec.pow2,
                                     interpret=True)
  want = qlayers.scaling.quantize(w, spec, 0)
  np.testing.assert_array_equal(ck.bits(q), ck.bits(want.payload))
  np.testing.assert_array_equal(ck.bits(qt), ck.bits(want.payload).T)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(want.scale))
  with table.target_arch(arch):
    assert qlayers.operands.pairable(w, Operand(spec, 1))
    last, first = operand_pair(w, Operand(spec, 1))
  np.testing.assert_array_equal(ck.bits(first.payload), ck.bits(want.payload))
  np.testing.assert_array_equal(np.asarray(last.scale),
                                np.asarray(want.scale))


def test_mx_pair_for_blackwell_holds_operands_values():
  t = ck.data((2, 32, 96), jnp.bfloat16)
  spec = ck.spec("mxfp8")
  last_op, first_op = Operand(spec, 1), Operand(spec, 0)
  want = (operand(t, last_op), operand(t, first_op))
  with table.target_arch("sm_100"):
    got = operand_pair(t, last_op, first_op)
    cuda = jax.jit(lambda t: operand_pair(t, last_op, first_op)).trace(
        t).lower(lowering_platforms=("cuda",)).as_text()
  for g, w in zip(got, want):
    assert (g.axis, g.block, g.shape) == (w.axis, w.block, w.shape)
    np.testing.assert_array_equal(ck.bits(g.payload), ck.bits(w.payload))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(w.scale))
  assert "qlayers_mx_cast_transpose" in cuda
  with table.target_arch("sm_90"):  # emulated there, on the pair's copies
    assert qlayers.operands.pairable(t, last_op, first_op)
  with table.target_arch("sm_89"):  # no kernel before Hopper
    assert not qlayers.operands.pairable(t, last_op, first_op)


# Each recipe (the formats) and each arch (which copies are dequantized)
# once; the kernel's copies of the other two pairs are pinned bit for bit
# by test_mxfp6_copies_are_widened_quantize_of_t_and_t_transposed and
# test_dequantized_mx_copies_are_the_bf16_values_bit_for_bit[e4m3].
@pytest.mark.parametrize("recipe,formats_made,arch", [
    ("mxfp6", ["e2m3", "e2m3", "e3m2"], "sm_90"),
    ("mxfp8", ["e4m3"] * 3, "sm_100")])
def test_mx_matmul_runs_the_pair_kernels_with_the_operands_bits(
    monkeypatch, recipe, formats_made, arch):
  """mxfp6 and mxfp8 traced for Blackwell (cuDNN's MXFP8 GEMM) and Hopper
  (BF16 GEMMs on dequantized copies), with the pair kernels run in Pallas'
  interpreter on CPU: x, w and g each take one kernel, whose copies (MXFP6
  in E4M3; on Hopper the BF16 dequantized values where a GEMM reads them at
  once) hand the GEMMs the unpaired operands' values: output and gradients
  keep the unpaired matmul's bits."""
  made = []
  want, got = ck.paired_against_unpaired(
      monkeypatch, recipe, arch, "mx_cast_transpose",
      lambda t, args, kw: made.append(
          (formats.get_format(args[0]).name, kw["dequantized"])))
  # x, w, then g; dequantized where no MX tensor cores read them, but the
  # copies kept for the backward pass (x's for Wgrad, w's for Dgrad) stay
  # quantized.
  hopper = arch == "sm_90"
  assert made == [(f, d) for f, d in zip(formats_made, [
      (hopper, False), (False, hopper), (hopper, hopper)])]
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# E2M3's dequantized copies: test_mx_matmul_runs_the_pair_kernels_with_the_
# operands_bits[mxfp6-...-sm_90] (x's, into the Fprop GEMM, bit for bit).
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2"])
def test_dequantized_mx_copies_are_the_bf16_values_bit_for_bit(fmt):
  """``dequantized`` copies: `scaling.dequantized` of the quantized rows of
  t and t.T (NaN for the NaN's block, the subnormal scale of a block of
  tiny values), with the same E8M0 scales."""
  t = ck.data((96, 160), jnp.float32).at[64:, 128:].set(1e-39)
  spec = qlayers.scaling.QuantSpec(format=fmt, granularity="mx")
  q, s, qt, st = ct.mx_cast_transpose(t, fmt, "mx_rceil",
                                      dequantized=(True, True),
                                      interpret=True)
  rows, cols = (qlayers.scaling.dequantized(
      qlayers.scaling.quantize(a, spec, 1)) for a in (t, t.T))
  assert q.dtype == qt.dtype == jnp.bfloat16
  for got, want in ((q, rows.payload), (s, rows.scale), (qt, cols.payload),
                    (st, cols.scale)):
    np.testing.assert_array_equal(ck.bits(got), ck.bits(want))
  assert np.isnan(np.asarray(q[0, 0], np.float32))
  assert rows.dequantized
  np.testing.assert_array_equal(
      np.asarray(rows.dequantize()),
      np.asarray(qlayers.scaling.quantize(t, spec, 1).dequantize(
          jnp.bfloat16), np.float32))
  with pytest.raises(ValueError, match="dequantized values"):
    rows.elements()
  with pytest.raises(ValueError, match="MX scale rule"):
    ct.mx_cast_transpose(jnp.ones((128, 128)), "e4m3", "deepseek_pow2",
                         block_size=128, dequantized=(True, False),
                         interpret=True)
  # One copy dequantized, the other as quantized.
  q2, _, qt2, _ = ct.mx_cast_transpose(t, fmt, "mx_rceil",
                                       dequantized=(False, True),
                                       interpret=True)
  np.testing.assert_array_equal(np.asarray(qt2).view(np.uint8),
                                np.asarray(qt).view(np.uint8))
  assert q2.dtype == (jnp.float8_e4m3fn if fmt in ("e4m3", "e2m3", "e3m2")
                      else jnp.float8_e5m2)
