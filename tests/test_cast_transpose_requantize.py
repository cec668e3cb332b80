"""A stored MX copy requantized along its other axis from its codes
(qlayers/cast_transpose/requantize.py), and the frozen kernel's Dgrad copy
it makes on GPUs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers import cast_transpose as ct
from qlayers import formats
from qlayers import scaling
from qlayers import table
from qlayers.dispatch import Operand
from qlayers.operands import operand, requantized_operand
from _support import cast_kernels as ck
from _support.helpers import Scanned


def _every_code_copy(fmt: str, rule: str) -> scaling.QTensor:
  """A (64, 256) copy along axis 1 holding every code of ``fmt`` in every
  row (E4M3: all 256, NaN's two included; FP6: all 64, four times; E2M1:
  all 16, 16 times), with scales from the smallest (2**-127, a subnormal)
  through the largest to the NaN scale, among ordinary ones."""
  spec = scaling.QuantSpec(format=fmt, granularity="mx", scale_rule=rule)
  q = scaling.quantize(jnp.zeros((64, 256)), spec, 1)
  n = 2 ** formats.get_format(fmt).bits
  # Every code in each row, rotated by three more per row.
  codes = ((np.arange(256)[None, :] + 3 * np.arange(64)[:, None]) % n
           ).astype(np.uint8)
  rng = np.random.default_rng(0)
  scales = rng.integers(110, 140, size=q.scale.shape, dtype=np.uint8)
  scales[0, :4] = (0, 1, 254, 255)
  if fmt == "e4m3":
    payload = jnp.asarray(codes).view(jnp.float8_e4m3fn)
  else:
    payload = formats.pack(jnp.asarray(codes), fmt)
  return dataclasses.replace(q, payload=payload, scale=jnp.asarray(scales))


@pytest.mark.parametrize("fmt,rule", [
    ("e4m3", "mx_rceil"), ("e4m3", "mx_floor"), ("e2m3", "mx_rceil"),
    ("e3m2", "mx_floor"), ("e2m1", "mx_rceil"), ("e2m1", "mx_floor")])
def test_every_code_requantizes_as_its_dequantized_values(fmt, rule):
  # FP6 goes in and comes out with its values in E4M3 (`scaling.widened`).
  stored = _every_code_copy(fmt, rule)
  spec = scaling.QuantSpec(format=fmt, granularity="mx", scale_rule=rule)
  finish = scaling.widened if spec.fmt.bits == 6 else (lambda q: q)
  qt, st = ct.mx_requantize(finish(stored).payload, stored.scale, fmt, rule,
                            interpret=True)
  want = finish(scaling.quantize(stored.dequantize().T, spec, 1))
  assert qt.dtype == want.payload.dtype and qt.shape == want.payload.shape
  np.testing.assert_array_equal(ck.bits(qt), ck.bits(want.payload))
  np.testing.assert_array_equal(np.asarray(st), np.asarray(want.scale))
  assert (np.asarray(st) == 255).any()  # the NaN scale's block, and codes


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_a_fixed_point_copy_comes_back_transposed(fmt):
  # MX codes quantized from data, read back along the other axis: the same
  # values the pair kernel gives the dequantized weight's copy along N.
  spec = qlayers.recipe("mxfp8" if fmt == "e4m3" else "mxfp4").fprop.rhs
  w = ck.data((128, 96), jnp.float32)  # NaN, Inf, overflow, tiny values
  stored = scaling.quantize(w, spec, 1)
  qt, st = ct.mx_requantize(stored.payload, stored.scale, fmt,
                            spec.scale_rule, interpret=True)
  pair = (ct.mx_cast_transpose(stored.dequantize(), fmt, spec.scale_rule,
                               interpret=True) if fmt == "e4m3" else
          ct.fp4_cast_transpose(stored.dequantize(), spec.scale_rule,
                                interpret=True))
  np.testing.assert_array_equal(ck.bits(qt), ck.bits(pair[2]))
  np.testing.assert_array_equal(np.asarray(st), np.asarray(pair[3]))


def test_an_nvfp4_copy_requantizes_as_its_dequantized_values():
  # Codes that are not the fixed point of NVFP4's quantization (every code
  # in every row, a checkpoint's), under block scales from E4M3's smallest
  # subnormal to its largest and a tensor scale: the tensor amax and both
  # scale levels come out as quantizing the dequantized transpose does.
  spec = qlayers.recipe("nvfp4").fprop.rhs
  w = ck.data((64, 128), jnp.float32)[:, ::-1] * 0.01  # finite, tiny values
  stored = scaling.quantize(jnp.nan_to_num(w, posinf=7.0, neginf=-7.0),
                            spec, 1)
  codes = ((np.arange(128)[None, :] + 5 * np.arange(64)[:, None]) % 16
           ).astype(np.uint8)
  block = np.asarray(stored.block_scale).copy()
  block.view(np.uint8)[0, :3] = (1, 0x7E, 0x30)  # 2**-9, 448, 0.5
  stored = dataclasses.replace(
      stored, payload=formats.pack(jnp.asarray(codes), "e2m1"),
      block_scale=jnp.asarray(block),
      scale=jnp.asarray(block).astype(jnp.float32) * stored.tensor_scale)
  amax = qlayers.blocks.amax(stored.dequantize())
  assert ck.bits(ct.nvfp4_amax(stored.payload, stored.scale)) == ck.bits(amax)
  qt, st = ct.nvfp4_requantize(stored.payload, stored.scale, amax,
                               interpret=True)
  want = scaling.quantize(stored.dequantize().T, spec, 1)
  np.testing.assert_array_equal(np.asarray(qt), np.asarray(want.payload))
  np.testing.assert_array_equal(ck.bits(st), ck.bits(want.block_scale))
  # not a fixed point: the copy holds other codes than the stored ones
  assert (np.asarray(formats.unpack(qt, "e2m1")) != codes.T).any()


def test_nvfp4_amax_is_the_dequantized_values_amax():
  # From the codes' integer maxima: the same FP32 bits as the amax of the
  # dequantized values, Inf where a block's scale is NaN or Inf (its zeros
  # times it are NaN), a negative scale's magnitudes.
  spec = qlayers.recipe("nvfp4").fprop.rhs
  rng = np.random.default_rng(1)
  stored = scaling.quantize(
      jnp.asarray(rng.normal(size=(64, 96)), jnp.float32), spec, 1)
  for scale in (1.0, -1.0, np.nan, np.inf, 0.0):
    codes = rng.integers(0, 256, stored.payload.shape).astype(np.uint8)
    codes[:16, :8] = 0x88  # -0 everywhere in the first block
    s = np.asarray(stored.scale).copy()
    s[0, 0] *= scale
    q = dataclasses.replace(stored, payload=jnp.asarray(codes),
                            scale=jnp.asarray(s), block_scale=None,
                            tensor_scale=None)
    want = qlayers.blocks.amax(q.dequantize())
    assert ck.bits(ct.nvfp4_amax(q.payload, q.scale)) == ck.bits(want), scale


def test_requantize_names_what_it_does_not_take():
  q = scaling.quantize(jnp.ones((64, 64)), qlayers.recipe("mxfp8").fprop.rhs,
                       1)
  with pytest.raises(ValueError, match="E4M3, FP6"):
    ct.mx_requantize(q.payload, q.scale, "e5m2", "mx_rceil")
  with pytest.raises(ValueError, match="packed, uint8"):
    ct.mx_requantize(q.payload, q.scale, "e2m1", "mx_rceil")
  with pytest.raises(ValueError, match="whole 32 x 32 tiles"):
    ct.mx_requantize(q.payload[:, :48], q.scale, "e4m3", "mx_rceil")
  with pytest.raises(ValueError, match="one E8M0 scale per 32"):
    ct.mx_requantize(q.payload, q.scale[:, :1], "e4m3", "mx_rceil")
  with pytest.raises(ValueError, match="MX scale rule"):
    ct.mx_requantize(q.payload, q.scale, "e4m3", "deepseek")


@pytest.mark.parametrize("recipe,arch", [
    ("mxfp8", "sm_100"), ("mxfp6", "sm_100"), ("mxfp4", "sm_100"),
    ("nvfp4", "sm_100"), ("mxfp8", "sm_90"), ("nvfp4", "sm_90")])
def test_a_frozen_kernels_dgrad_copy_is_made_from_its_codes(recipe, arch):
  # A LoRA step on a frozen MX or NVFP4 base made Dgrad's copy by
  # dequantizing the codes to FP32 in XLA, then the pair kernel (11 bytes
  # moved per MXFP8 weight): planned for B200 or H200 (which dequantizes MX
  # copies for its BF16 GEMM) it is one kernel from the codes, and the
  # input gradient keeps its bits.
  layer = qlayers.QuantDense(256, 128, recipe=recipe, rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  qlayers.add_lora(layer, 4, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32)

  def dx(model, x):  # nnx.grad: NVFP4's rounding counter is state
    return nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=1)(model, x)

  graph, state = nnx.split(layer)
  step = jax.jit(lambda state, x: dx(nnx.merge(graph, state), x))
  want = step(state, x)
  with table.target_arch(arch):
    got = jax.jit(lambda state, x: dx(nnx.merge(graph, state), x))(state, x)
    text = jax.jit(lambda state, x: dx(nnx.merge(graph, state), x)).trace(
        state, x).lower(lowering_platforms=("cuda",)).as_text()
  kernel = "nvfp4" if recipe == "nvfp4" else "mx"
  assert text.count(f'name = "qlayers_{kernel}_requantize"') == 1
  np.testing.assert_array_equal(ck.bits(got), ck.bits(want))


def test_a_scanned_stack_of_frozen_kernels_reads_each_layers_codes():
  # A model scanned over its frozen layers: planned for B200, each layer's
  # GEMM takes its own codes (the scan body holds one requantize kernel,
  # for Dgrad's copy, and no FP32 pass over a kernel), with the bits of
  # the program run on CPU.
  model = Scanned(lambda rngs: nnx.Linear(256, 256, rngs=rngs),
                  nnx.Rngs(0))
  qlayers.quantize(model, "mxfp8", frozen=True)
  qlayers.add_lora(model, 4, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32)
  graph, state = nnx.split(model)

  def dx(state, x):
    return nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=1)(
        nnx.merge(graph, state), x)
  want = jax.jit(dx)(state, x)
  with table.target_arch("sm_100"):
    got = jax.jit(dx)(state, x)
    text = jax.jit(dx).trace(state, x).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count('name = "qlayers_mx_requantize"') == 1
  assert "stablehlo.while" in text
  np.testing.assert_array_equal(ck.bits(got), ck.bits(want))


def test_no_dgrad_copy_from_codes_where_the_weight_specs_differ():
  # Fprop's weight scaled by MX's FLOOR rule, Dgrad's by RCEIL: no pair
  # kernel runs there, and its MXFP6 copy is packed where the kernel's is
  # widened, so the codes are dequantized and quantized as before (found
  # by review).
  base = qlayers.recipe("mxfp6")
  recipe = base.replace(fprop=dataclasses.replace(
      base.fprop, rhs=dataclasses.replace(base.fprop.rhs,
                                          scale_rule="mx_floor")))
  layer = qlayers.QuantDense(256, 128, recipe=recipe, rngs=nnx.Rngs(0))
  qlayers.freeze(layer)
  x = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32)
  graph, state = nnx.split(layer)

  def dx(state, x):
    return nnx.grad(lambda m, x: jnp.sum(m(x)), argnums=1)(
        nnx.merge(graph, state), x)
  with table.target_arch("sm_100"):
    text = jax.jit(dx).trace(state, x).lower(
        lowering_platforms=("cuda",)).as_text()
  assert 'name = "qlayers_mx_requantize"' not in text


def test_requantized_operand_only_where_its_kernel_takes_the_copy():
  spec = qlayers.recipe("mxfp8").dgrad.rhs
  q = scaling.quantize(jnp.ones((64, 96)), spec, 1)
  op = Operand(spec, 1)
  assert requantized_operand(q, op) is None  # not lowered for a GPU
  with table.target_arch("sm_100"):
    made = requantized_operand(q, op)
    assert made is not None
    want = operand(q.dequantize().T, op)
    assert jax.tree.structure(made) == jax.tree.structure(want)
    np.testing.assert_array_equal(ck.bits(made.payload),
                                  ck.bits(want.payload))
    # A transform, a transposed copy, another format, Hopper's FP8 GEMM
    assert requantized_operand(q, Operand(spec, 1, hadamard=32)) is None
    assert requantized_operand(dataclasses.replace(q, transposed=True),
                               op) is None
    e5m2 = dataclasses.replace(spec, format="e5m2")
    assert requantized_operand(q, Operand(e5m2, 1)) is None
  with table.target_arch("sm_89"):
    assert requantized_operand(q, op) is None
