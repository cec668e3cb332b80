"""NVFP4 (recipes/nvfp4.toml): the two-level scales and E2M1 payloads bit for
bit against the NumPy reference, the 16 x 16 weight blocks (w and w.T alike),
the 16-point Hadamard transform, the step-keyed stochastic rounding, and the
forward SQNR against MXFP4."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from _support import reference_numpy as ref
from _support.numerics import sqnr_db
from qlayers import dispatch, formats, hadamard, operands, ops, scale_rules
from qlayers import scaling
from qlayers.recipe_rules import nvfp4_wide_blocks, seed_rounding
from qlayers.scaling import QuantSpec

TILE = QuantSpec(format="e2m1", granularity="tile", scale_rule="nvfp4")
BLOCK = QuantSpec(format="e2m1", granularity="block", scale_rule="nvfp4")
F32_MAX = float(np.finfo(np.float32).max)
# One compiled program per case (eager quantize compiles op by op).
quantize = jax.jit(scaling.quantize, static_argnums=(1, 2))


def _wide_range(shape, seed):
  """Gaussian rows over 2**-20 .. 2**20 (E4M3 block scales underflow in the
  small rows), a zero block and an exact-tie row."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 21,
                                                        (shape[0], 1)))
  x[0, :16] = 0.0
  x[1, :6] = [6.0, 5.0, 2.5, 0.75, 0.25, -3.5]  # E2M1 ties after scale 1
  return x.astype(np.float32)


@pytest.mark.parametrize("spec,shape", [(TILE, (7, 40)), (TILE, (3, 16)),
                                        (BLOCK, (37, 40)), (BLOCK, (16, 48))])
def test_quantize_matches_numpy_reference(spec, shape):
  for seed in (0, 1):  # in one test: both seeds run one compiled program
    x = _wide_range(shape, seed)
    q = quantize(jnp.asarray(x), spec, 1)
    codes, scale = ref.quantize(x, "e2m1", spec.granularity, 1, rule="nvfp4")
    np.testing.assert_array_equal(np.asarray(q.payload),
                                  ref.pack(codes, "e2m1"), str(seed))
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint32),
                                  scale.view(np.uint32), str(seed))
    want = ref.dequantize(codes, scale, "e2m1", shape, spec.granularity, 1,
                          block_size=16)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), want,
                                  str(seed))


def test_given_tensor_amax_is_the_second_level():
  x = _wide_range((4, 32), 3)
  q = quantize(jnp.asarray(x), TILE, 1, amax=jnp.float32(1e7))
  codes, scale = ref.quantize(x, "e2m1", "tile", 1, rule="nvfp4",
                              tensor_amax=1e7)
  np.testing.assert_array_equal(np.asarray(q.scale), scale)
  np.testing.assert_array_equal(np.asarray(q.payload), ref.pack(codes, "e2m1"))


def test_scales_by_hand_and_special_amaxes():
  # Tensor amax 6: S_enc = 448, a block of amax 6 gets E4M3 448 (scale 1),
  # of amax 3 gets 224 (scale 1/2); a zero block gets scale 0.
  mult, scale, e4m3 = scale_rules.nvfp4_scales(jnp.array([6.0, 3.0, 0.0]),
                                               jnp.float32(6.0))  # jitted
  assert np.asarray(e4m3).tolist() == [448.0, 224.0, 0.0]
  assert np.asarray(scale).tolist() == [1.0, 0.5, 0.0]
  assert np.asarray(mult).tolist() == [1.0, 2.0, F32_MAX]
  s = jax.jit(scale_rules.nvfp4_encode_scale)(
      jnp.array([0.0, np.inf, 2e-38, 2688.0]))
  assert np.asarray(s).tolist() == [1.0, 1.0, F32_MAX, 1.0]
  q = quantize(jnp.zeros((2, 32)), TILE, 1)
  assert not np.asarray(q.payload).any()
  assert not np.asarray(q.dequantize()).any()
  # A block holding Inf or NaN (and so the tensor) gets NaN scales.
  x = jnp.ones((2, 32)).at[0, 3].set(jnp.nan)
  assert np.isnan(np.asarray(quantize(x, TILE, 1).scale)).all()


def test_spec_errors_name_the_problem():
  with pytest.raises(ValueError, match="'nvfp4' takes format 'e2m1'"):
    QuantSpec(format="e4m3", granularity="tile", scale_rule="nvfp4")
  with pytest.raises(ValueError, match="does not fit granularity 'mx'"):
    QuantSpec(format="e2m1", granularity="mx", scale_rule="nvfp4")
  with pytest.raises(ValueError, match="block_size must be 16"):
    QuantSpec(format="e2m1", granularity="tile", scale_rule="nvfp4",
              block_size=32)
  with pytest.raises(ValueError, match="scale_rule='nvfp4' for E2M1"):
    QuantSpec(format="e2m1", granularity="tile")
  assert scaling.bytes_per_element(TILE) == 0.5 + 1 / 16


def test_weight_blocks_quantize_w_and_w_t_alike():
  w = jnp.asarray(_wide_range((40, 56), 4))
  plan = dispatch.plan(qlayers.recipe("nvfp4"), (8, 40), jnp.float32,
                       (40, 56), jnp.float32)

  @jax.jit
  def copies(w):
    def d(t, spec):
      return scaling.quantize(t, spec, 1).dequantize()
    return (d(w, BLOCK), d(w.T, BLOCK).T, d(w, TILE), d(w.T, TILE).T,
            # The recipe's Fprop copy (of w.T, contraction-last) and Dgrad's.
            operands.operand(w, plan.fprop.rhs).dequantize().T,
            operands.operand(w, plan.dgrad.rhs).dequantize())

  block, block_t, tile, tile_t, fprop, dgrad = map(np.asarray, copies(w))
  np.testing.assert_array_equal(block, block_t)
  assert not np.array_equal(tile, tile_t)  # 1 x 16 tiles do not have it
  np.testing.assert_array_equal(fprop, dgrad)
  np.testing.assert_array_equal(fprop, block)


def test_16_point_hadamard_is_orthogonal_on_wgrad_only():
  r = qlayers.recipe("nvfp4")
  assert (r.fprop.hadamard, r.dgrad.hadamard, r.wgrad.hadamard) == (0, 0, 16)
  q = (hadamard.hadamard_matrix(16).astype(np.float64)
       * hadamard.random_signs(16)[None, :])
  assert set(np.unique(np.abs(q))) == {0.25}
  np.testing.assert_array_equal(q @ q.T, np.eye(16))  # exact: entries +-1/4
  a = jax.random.normal(jax.random.key(0), (48, 5))
  b = jax.random.normal(jax.random.key(1), (48, 3))
  # Jitted: one compile, not one per op of the butterfly's stages.
  qa, qb = jax.jit(lambda a, b: (hadamard.transform(a, 16),
                                 hadamard.transform(b, 16)))(a, b)
  np.testing.assert_allclose(qa.T @ qb, a.T @ b, rtol=1e-5, atol=1e-5)


def test_recipe_fields():
  r = qlayers.recipe("nvfp4")
  assert r.sr_key == "step" and "nvfp4" in qlayers.available_recipes()
  for role, spec in r.specs().items():
    assert (spec.format, spec.scale_rule, spec.block_size) == ("e2m1",
                                                               "nvfp4", 16)
    assert spec.granularity == ("block" if role.endswith(".w") else "tile")
    assert spec.stochastic == role.endswith(".g")
  with pytest.raises(ValueError, match="no operand rounds stochastically"):
    qlayers.recipe("mxfp8", sr_key="step")


def test_forward_sqnr_nvfp4_above_mxfp4(capsys):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (256, 512))
  w = jax.random.normal(kw, (512, 256))
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  db = {name: sqnr_db(exact, jax.jit(
      lambda x, w, r=qlayers.recipe(name): ops.quantized_matmul(
          x, w, r, None)[0])(x, w)) for name in ("nvfp4", "mxfp4")}
  with capsys.disabled():
    print(f"\nforward GEMM SQNR on Gaussian data (256x512 @ 512x256): "
          f"nvfp4 {db['nvfp4']:.2f} dB, mxfp4 {db['mxfp4']:.2f} dB")
  assert db["nvfp4"] >= db["mxfp4"] + 0.5


@nnx.jit
def _grads(model, x, key_step):
  model.quant.sr_step.set_value(key_step)
  return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)["kernel"][...]


@nnx.jit
def _call(model, x):
  return model(x)


def test_stochastic_rounding_key_comes_from_the_step_not_the_data():
  model = qlayers.QuantDense(32, 32, rngs=nnx.Rngs(0), recipe="nvfp4")
  model.quant.sr_seed.set_value(jnp.uint32(0))
  x = jax.random.normal(jax.random.key(1), (64, 32))
  g0, g0_again, g1 = (_grads(model, x, jnp.uint32(s)) for s in (0, 0, 1))
  np.testing.assert_array_equal(np.asarray(g0), np.asarray(g0_again))
  assert not np.array_equal(np.asarray(g0), np.asarray(g1))
  # The key is formats.rounding_key(seed, step), and the seed changes the
  # draw too.
  k = jax.random.key_data(model.quant.rounding_key())  # after step 1's call
  want = jax.random.key_data(formats.rounding_key(jnp.uint32(0),
                                                  jnp.uint32(2)))
  np.testing.assert_array_equal(np.asarray(k), np.asarray(want))
  model.quant.sr_seed.set_value(jnp.uint32(9))
  assert not np.array_equal(np.asarray(_grads(model, x, jnp.uint32(0))),
                            np.asarray(g0))
  model.quant.sr_seed.set_value(jnp.uint32(0))
  # A training call advances the counter; an eval call does not.
  model.quant.sr_step.set_value(jnp.uint32(0))
  _call(model, x)
  assert int(model.quant.sr_step[...]) == 1
  model.eval()
  _call(model, x)
  assert int(model.quant.sr_step[...]) == 1


def test_companion_rules_and_seeds():
  rules = nvfp4_wide_blocks(12)
  assert [r.pattern for r in rules[:-2]] == ["(^|/)blocks/10/",
                                             "(^|/)blocks/11/"]
  assert len(nvfp4_wide_blocks(62)) == 10 + 2  # the paper's 2 + 8, defaults
  with pytest.raises(ValueError, match="do not fit"):
    nvfp4_wide_blocks(2, first=2, last=1)
  model = nnx.Sequential(
      *(qlayers.QuantDense(16, 16, rngs=nnx.Rngs(i), recipe="nvfp4")
        for i in range(3)))
  assert seed_rounding(model) == 3
  seeds = {int(layer.quant.sr_seed[...]) for layer in model.layers}
  assert len(seeds) == 3


def test_layers_built_by_hand_get_seeds_from_their_initial_weights():
  # Without it every hand-built layer had seed 0: layers of equal shapes
  # drew the same rounding bits at every step.
  def seeds(key):
    layers = [qlayers.QuantDense(16, 16, rngs=nnx.Rngs(key + i),
                                 recipe="nvfp4") for i in range(3)]
    return [int(layer.quant.sr_seed[...]) for layer in layers]

  assert len(set(seeds(0))) == 3
  assert seeds(0) == seeds(0)  # the same initial weights, the same seeds
  layer = qlayers.QuantDense(16, 16, rngs=nnx.Rngs(0), recipe="nvfp4")
  bits = jax.lax.bitcast_convert_type(layer.kernel[...], jnp.uint32)
  assert int(layer.quant.sr_seed[...]) == int(jnp.sum(bits, dtype=jnp.uint32))


def test_optimizer_warns_where_hand_made_gemms_share_seeds_or_state():
  """nnx.Linear(dot_general=QuantGemm("nvfp4")) layers all start at seed 0,
  and one QuantGemm passed to several layers shares its state: the
  Optimizer says so; after seed_rounding, with a QuantGemm each, it is
  silent."""
  def model(make):
    return nnx.Sequential(*(nnx.Linear(16, 16, dot_general=make(),
                                       rngs=nnx.Rngs(i)) for i in range(2)))
  hand = model(lambda: qlayers.QuantGemm("nvfp4"))
  with pytest.warns(UserWarning, match="same rounding seed"):
    qlayers.Optimizer(hand, optax.sgd(0.1))
  assert seed_rounding(hand, seed=np.int64(3)) == 2
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qlayers.Optimizer(hand, optax.sgd(0.1))
  one = qlayers.QuantGemm("fp8_delayed")
  with pytest.warns(UserWarning, match="dot_general of layers with different"):
    qlayers.Optimizer(model(lambda: one), optax.sgd(0.1))
  with pytest.raises(TypeError, match="seed must be an integer"):
    seed_rounding(hand, seed=1.5)
  # A tied head reads the embedding's table: equal seeds, not a hand-made
  # GEMM's, and no warning.
  embed = qlayers.layers.QuantEmbed(32, 16, recipe="nvfp4",
                                    rngs=nnx.Rngs(0))
  tied = nnx.Sequential(embed, qlayers.QuantLogits(embed=embed,
                                                   recipe="nvfp4"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qlayers.Optimizer(tied, optax.sgd(0.1))


def test_quantize_gives_each_layer_its_own_rounding_seed():
  model = nnx.Sequential(*(nnx.Linear(16, 16, rngs=nnx.Rngs(i))
                           for i in range(3)))
  qlayers.quantize(model, "nvfp4")
  seeds = [int(layer.quant.sr_seed[...]) for layer in model.layers]
  assert len(set(seeds)) == 3, seeds  # without it every layer had seed 0
  again = nnx.Sequential(*(nnx.Linear(16, 16, rngs=nnx.Rngs(i))
                           for i in range(3)))
  qlayers.quantize(again, "nvfp4")  # from the path: the same seeds
  assert [int(l.quant.sr_seed[...]) for l in again.layers] == seeds


def test_checkpoint_carries_the_rounding_counter(tmp_path):
  # A resumed run continues the same stochastic-rounding stream.
  model = qlayers.QuantDense(32, 32, rngs=nnx.Rngs(0), recipe="nvfp4")
  model.quant.sr_step.set_value(jnp.uint32(41))
  model.quant.sr_seed.set_value(jnp.uint32(7))
  qlayers.checkpoint.save(tmp_path / "ck", model)
  fresh = qlayers.QuantDense(32, 32, rngs=nnx.Rngs(1), recipe="nvfp4")
  assert qlayers.checkpoint.restore(tmp_path / "ck", fresh)["restored"] == \
      "full"
  assert (int(fresh.quant.sr_step[...]), int(fresh.quant.sr_seed[...])) == (
      41, 7)


def test_logits_head_rounds_gradients_by_its_step_counter():
  head = qlayers.QuantLogits(32, 64, rngs=nnx.Rngs(0), recipe="nvfp4")
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  labels = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
  grad = {c: nnx.jit(nnx.grad(lambda m, x, c=c: m.loss(x, labels,
                                                       chunk_size=c),
                              argnums=1)) for c in (None, 8)}

  def dx(step, chunk_size=None):
    model = nnx.clone(head)
    model.quant.sr_step.set_value(jnp.uint32(step))
    g = grad[chunk_size](model, x)
    assert int(model.quant.sr_step[...]) == step + 1  # one step per call
    return np.asarray(g)

  np.testing.assert_array_equal(dx(5), dx(5))  # the counter, not the data
  assert not np.array_equal(dx(5), dx(6))
  np.testing.assert_array_equal(dx(5, chunk_size=8), dx(5, chunk_size=8))


def test_quantize_leaves_the_seeds_of_layers_it_does_not_convert():
  model = nnx.Sequential(
      qlayers.QuantDense(16, 16, rngs=nnx.Rngs(0), recipe="nvfp4"),
      nnx.Linear(16, 16, rngs=nnx.Rngs(1)))
  seed_rounding(model, seed=1234)
  kept = int(model.layers[0].quant.sr_seed[...])
  qlayers.quantize(model, "nvfp4", rules=())
  assert int(model.layers[0].quant.sr_seed[...]) == kept
  fresh = nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
                         nnx.Linear(16, 16, rngs=nnx.Rngs(1)))
  qlayers.quantize(fresh, "nvfp4", rules=())  # the converted one: by path
  assert int(model.layers[1].quant.sr_seed[...]) == int(
      fresh.layers[1].quant.sr_seed[...])
