"""qlayers.hf.load_tensors: Hugging Face tensors into a model, FP8 weights
as frozen kernels."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import qlayers
from qlayers import checkpoint
from qlayers.hf import load_tensors


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(256, rngs=rngs)
    self.proj = qlayers.QuantDense(256, 128, recipe="fp8_current",
                                   use_bias=False, rngs=rngs)


NAMES = {"norm.scale": "model.norm.weight",
         "proj.kernel": "model.proj.weight"}


@pytest.fixture
def tensors(tmp_path):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((128, 256)) * 0.1).astype(np.float32)
  norm = (1 + rng.standard_normal(256) * 0.1).astype(ml_dtypes.bfloat16)
  checkpoint.write_safetensors(tmp_path, {"model.proj.weight": w,
                                          "model.norm.weight": norm})
  return tmp_path


def test_fp8_weights_load_frozen_or_exact(tensors):
  q = checkpoint.read_safetensors(tensors, quantized=True)
  deq = checkpoint.read_safetensors(tensors)
  frozen = Block(nnx.Rngs(0))
  assert load_tensors(frozen, q, NAMES) == 2
  assert isinstance(frozen.proj.kernel, qlayers.FrozenKernel)
  assert "kernel" not in nnx.state(frozen.proj, nnx.Param)
  np.testing.assert_array_equal(
      np.asarray(frozen.proj.kernel.payload[...]).view(np.uint8),
      np.asarray(q["model.proj.weight"].payload).view(np.uint8))
  wide = Block(nnx.Rngs(1))
  load_tensors(wide, q, NAMES, frozen=False)
  np.testing.assert_array_equal(wide.proj.kernel[...],
                                deq["model.proj.weight"].T)
  np.testing.assert_array_equal(frozen.proj.kernel[...], wide.proj.kernel[...])
  assert wide.norm.scale.dtype == jnp.float32  # the model's dtype
  np.testing.assert_array_equal(wide.norm.scale[...], deq[
      "model.norm.weight"].astype(np.float32))


def test_load_errors_change_nothing(tensors):
  q = checkpoint.read_safetensors(tensors, quantized=True)
  block = Block(nnx.Rngs(0))
  before = np.asarray(block.norm.scale[...]).copy()
  bad = {**NAMES, "proj.bias": "model.proj.bias", "norm.scale": "model.x"}
  with pytest.raises(ValueError, match=r"norm.scale: no tensor 'model.x'; "
                                       r"proj.bias: no tensor"):
    load_tensors(block, q, bad)
  small = Block(nnx.Rngs(0))
  small.proj = qlayers.QuantDense(128, 128, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"proj.kernel: model \(128, 128\), "
                     r"tensor 'model.proj.weight' \(128, 256\) \(transposed\)"):
    load_tensors(small, q, NAMES)
  np.testing.assert_array_equal(block.norm.scale[...], before)
  assert isinstance(block.proj.kernel, nnx.Param)


@pytest.mark.parametrize("block,scale_format", [(64, "float32"),
                                                (128, "ue8m0")])
def test_merged_lora_keeps_the_checkpoint_layout(tmp_path, block,
                                                 scale_format):
  """A frozen FP8 kernel requantizes (`merge_lora`) in its checkpoint's
  blocks and scale format, so it writes back in them."""
  rng = np.random.default_rng(1)
  w = (rng.standard_normal((128, 256)) * 0.1).astype(np.float32)
  checkpoint.write_safetensors(tmp_path, {"model.proj.weight": w},
                               fp8_block=(block, block),
                               scale_format=scale_format)
  model = Block(nnx.Rngs(0))
  load_tensors(model, checkpoint.read_safetensors(tmp_path, quantized=True),
               {"proj.kernel": "model.proj.weight"})
  qlayers.add_lora(model, 4, rngs=nnx.Rngs(2))
  model.proj.lora.lora_b[...] = jnp.full((4, 128), 0.01, jnp.bfloat16)
  qlayers.merge_lora(model)
  qt = model.proj.kernel.qtensor()
  assert qt.block == (block, block)
  scale = np.asarray(qt.scale)
  assert (np.frexp(scale)[0] == 0.5).all() == (scale_format == "ue8m0")
  out = tmp_path / "merged"
  checkpoint.write_safetensors(out, {"model.proj.weight": qt},
                               fp8_block=(block, block),
                               scale_format=scale_format)
  back = checkpoint.read_safetensors(out, quantized=True)["model.proj.weight"]
  np.testing.assert_array_equal(np.asarray(back.scale), scale)


def test_a_tied_layer_loads_under_either_of_its_names(tmp_path):
  # ``lm_head`` shares the embedding (Hugging Face's tie_word_embeddings):
  # its second path was "no such Variable in the model".
  class Net(nnx.Module):
    def __init__(self):
      self.embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0))
      self.lm_head = self.embed
      self.blocks = nnx.List([nnx.Linear(8, 8, rngs=nnx.Rngs(1))])

  table = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
  d = checkpoint.write_safetensors(
      tmp_path / "t", {"w": table, "b": np.ones(8, np.float32)},
      fp8_block=None)
  net = Net()
  assert qlayers.hf.load_tensors(net, checkpoint.read_safetensors(d), {
      "lm_head.embedding": "w", "blocks.0.bias": "b"}) == 2
  np.testing.assert_array_equal(net.embed.embedding[...], table)
  np.testing.assert_array_equal(net.blocks[0].bias[...], np.ones(8))
  with pytest.raises(ValueError, match="blocks.1.bias: no such Variable"):
    qlayers.hf.load_tensors(net, checkpoint.read_safetensors(d),
                            {"blocks.1.bias": "b"})


@pytest.mark.parametrize("block", [(8, 8), (96, 96)])
def test_a_checkpoint_in_blocks_no_quantspec_takes_loads_exactly(tmp_path,
                                                                 block):
  # read_safetensors took 8 x 8 blocks, and load_tensors then failed inside
  # a QuantSpec the user never made, naming no tensor.
  import json
  from qlayers.safetensors import write_file
  rng = np.random.default_rng(0)
  codes = np.clip(rng.standard_normal((48, 40)) * 100, -448, 448).astype(
      ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(1e-3, 1e-2, (-(-48 // block[0]),
                                   -(-40 // block[1]))).astype(np.float32)
  write_file(tmp_path / "model.safetensors",
             {"up.weight": codes, "up.weight_scale_inv": scale})
  (tmp_path / "config.json").write_text(json.dumps(
      {"quantization_config": {"weight_block_size": list(block)}}))
  tensors = checkpoint.read_safetensors(tmp_path, quantized=True)
  layer = qlayers.QuantDense(40, 48, recipe="fp8_current", rngs=nnx.Rngs(0))
  load_tensors(layer, tensors, {"kernel": "up.weight"})
  want = codes.astype(np.float32) * np.repeat(
      np.repeat(scale, block[0], 0), block[1], 1)[:48, :40]
  np.testing.assert_array_equal(np.asarray(layer.kernel[...]), want.T)
  assert layer.kernel.spec.block_size == 128  # merge_lora requantizes so


@pytest.mark.parametrize("frozen", [True, False])
def test_attention_projections_load_their_2d_checkpoint_weights(tmp_path,
                                                                frozen):
  # Their kernels are (d, heads, head_dim) and (heads, head_dim, d): a 2-D
  # (out, in) QTensor could neither load nor be reshaped first.
  rng = np.random.default_rng(0)
  w = {"q.weight": rng.standard_normal((32, 48)).astype(np.float32),
       "o.weight": rng.standard_normal((48, 32)).astype(np.float32)}
  d = checkpoint.write_safetensors(tmp_path / "c", w, fp8_block=(16, 16))
  wide = checkpoint.read_safetensors(d)
  proj = qlayers.QuantAttentionProj(48, 4, 8, recipe="fp8_current",
                                    rngs=nnx.Rngs(0))
  assert load_tensors(proj, checkpoint.read_safetensors(d, quantized=True),
                      {"query.kernel": "q.weight", "out.kernel": "o.weight"},
                      frozen=frozen) == 2
  assert (type(proj.query.kernel).__name__ == "FrozenKernel") == frozen
  np.testing.assert_array_equal(np.asarray(proj.query.kernel[...]),
                                wide["q.weight"].T.reshape(48, 4, 8))
  np.testing.assert_array_equal(np.asarray(proj.out.kernel[...]),
                                wide["o.weight"].T.reshape(4, 8, 48))


def test_a_batched_linear_general_kernel_takes_no_flattened_tensor():
  # (batch, in..., out...): flattened as (in, out) it loaded the wrong way.
  layer = nnx.LinearGeneral((4, 8), 16, axis=(-2, -1), batch_axis={0: 3},
                            rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"model \(3, 4, 8, 16\)"):
    load_tensors(layer, {"w": np.zeros((128, 12), np.float32)},
                 {"kernel": "w"})


def test_loading_a_delayed_param_kernel_settles_its_weight_history():
  # The initial kernel's amax stayed in the history: the loaded weights
  # were scaled by it (in eval mode, for good).
  model = nnx.Sequential(qlayers.QuantDense(8, 4, recipe="fp8_delayed",
                                            rngs=nnx.Rngs(0)))
  model.layers[0].quant.w_amax_history[...] = jnp.full_like(
      model.layers[0].quant.w_amax_history[...], 0.01)
  weight = np.linspace(-3.0, 2.0, 32, dtype=np.float32).reshape(4, 8)
  load_tensors(model, {"w": weight}, {"layers.0.kernel": "w"}, frozen=False)
  history = model.layers[0].quant.w_amax_history[...]
  np.testing.assert_array_equal(history, np.full_like(history, 3.0))


def test_loading_a_delayed_embedding_table_settles_its_history():
  # A tied head quantizes the table through the embedding's GEMM.
  model = nnx.Sequential(qlayers.layers.QuantEmbed(
      8, 4, recipe="fp8_delayed", rngs=nnx.Rngs(0)))
  table = np.linspace(-5.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
  load_tensors(model, {"t": table}, {"layers.0.embedding": "t"},
               frozen=False)
  history = model.layers[0].quant.w_amax_history[...]
  np.testing.assert_array_equal(history, np.full_like(history, 5.0))


@pytest.mark.parametrize("frozen", [True, False])
def test_an_einsum_kernel_stored_out_in_loads_as_it_is(tmp_path, frozen):
  # "bd,fd->bf" keeps its kernel (out, in), as the checkpoint does: it was
  # transposed (a square one in silence, another refused as transposed),
  # while "bd,df->bf" is (in, out) and a stock nnx.Einsum the same.
  rng = np.random.default_rng(0)
  w = rng.standard_normal((16, 32)).astype(np.float32)
  d = checkpoint.write_safetensors(tmp_path / "c", {"p.weight": w},
                                   fp8_block=(16, 16))  # an FP8 QTensor
  q, wide = (checkpoint.read_safetensors(d, quantized=True),
             checkpoint.read_safetensors(d)["p.weight"])
  out_in = qlayers.QuantEinsum("bd,fd->bf", (16, 32), recipe="fp8_current",
                               rngs=nnx.Rngs(0))
  in_out = qlayers.QuantEinsum("bd,df->bf", (32, 16), recipe="fp8_current",
                               rngs=nnx.Rngs(0))
  stock = nnx.Einsum("bd,fd->bf", (16, 32), rngs=nnx.Rngs(0))
  for layer, want in ((out_in, wide), (in_out, wide.T), (stock, wide)):
    load_tensors(layer, q, {"kernel": "p.weight"}, frozen=frozen)
    np.testing.assert_array_equal(np.asarray(layer.kernel[...]), want)
  assert isinstance(in_out.kernel, qlayers.FrozenKernel) == frozen
  assert isinstance(out_in.kernel, nnx.Param)  # not frozen: as freeze
  square = qlayers.QuantEinsum("bd,fd->bf", (32, 32), recipe="bf16",
                               rngs=nnx.Rngs(0))
  w2 = rng.standard_normal((32, 32)).astype(np.float32)
  load_tensors(square, {"w": w2}, {"kernel": "w"})
  x = rng.standard_normal((2, 32)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(square(jnp.asarray(x))), x @ w2.T,
                             rtol=2e-2, atol=2e-2)


def test_reloading_a_frozen_kernel_keeps_its_sharding_names(tmp_path):
  # A second load (or one after quantize(frozen=True)) read the names off
  # the FrozenKernel as if a Param, found none, and stored it replicated.
  d = checkpoint.write_safetensors(tmp_path / "c", {
      "fc.weight": np.ones((128, 128), np.float32)})
  q = checkpoint.read_safetensors(d, quantized=True)
  layer = qlayers.QuantDense(128, 128, recipe="fp8_current",
                             kernel_metadata={"out_sharding": ("data",
                                                               "model"),
                                              "eager_sharding": False},
                             rngs=nnx.Rngs(0))
  for _ in range(2):
    load_tensors(layer, q, {"kernel": "fc.weight"})
    assert dict(layer.kernel.sharding)["out_sharding"] == ("data", "model")
    assert nnx.get_partition_spec(nnx.state(layer.kernel)).payload.get_value(
    ) == jax.sharding.PartitionSpec("model", "data")
