"""Output heads found by what the model does (tracing an example input), or
by shape without one; small stock-NNX models written as third parties do."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qlayers

D, V = 32, 96
X = jax.ShapeDtypeStruct((2, D), jnp.float32)
TOKENS = jax.ShapeDtypeStruct((2, 8), jnp.int32)


def wide(report):
  return sorted(k.path for k in report.kept_wide)


def converted(report):
  return sorted(c.path for c in report.converted)


class ClassifierFirst(nnx.Module):
  """The classifier is defined first in __init__ but applied last."""

  def __init__(self, rngs):
    self.score = nnx.Linear(2 * D, 10, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.mid = nnx.Linear(2 * D, 2 * D, rngs=rngs)

  def __call__(self, x):
    return self.score(nnx.relu(self.mid(nnx.relu(self.up(x)))))


def test_classifier_defined_first_applied_last_is_the_head():
  model = ClassifierFirst(nnx.Rngs(0))
  report = qlayers.quantize(model, "fp8_current", example_input=X)
  assert wide(report) == ["score"] and converted(report) == ["mid", "up"]
  assert type(model.score) is nnx.Linear
  assert "found by tracing example_input" in report.kept_wide[0].why
  assert report.head == "by tracing example_input: score"
  assert "output head, by tracing example_input: score" in str(report)


class TwoHeads(nnx.Module):

  def __init__(self, rngs):
    self.value = nnx.Linear(D, 1, rngs=rngs)
    self.trunk = nnx.Linear(D, D, rngs=rngs)
    self.policy = nnx.Linear(D, 6, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.trunk(x))
    return {"policy": self.policy(h), "value": jnp.tanh(self.value(h))}


def test_two_heads_both_kept_wide():
  report = qlayers.quantize(TwoHeads(nnx.Rngs(0)), "fp8_current",
                            example_input=X)
  assert wide(report) == ["policy", "value"]
  assert converted(report) == ["trunk"]


class Block(nnx.Module):

  def __init__(self, d, ff, rngs, fused=False):
    self.fused = fused
    if fused:
      self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
      self.proj = nnx.Linear(d, d, rngs=rngs)
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, ff, rngs=rngs)
    self.fc2 = nnx.Linear(ff, d, rngs=rngs)

  def __call__(self, x):
    if self.fused:
      q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
      a = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0) @ v
      x = x + self.proj(a)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln(x))))


class MiniGPT(nnx.Module):
  """Like Flax's MiniGPT example: blocks in an nnx.List, an untied
  ``output_layer``."""

  def __init__(self, vocab, d, ff, fused=False, n=2):
    rngs = nnx.Rngs(0)
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, ff, rngs, fused) for _ in range(n)])
    self.output_layer = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for b in self.blocks:
      x = b(x)
    return self.output_layer(x)


def test_minigpt_feed_forward_as_wide_as_the_vocabulary():
  report = qlayers.quantize(MiniGPT(V, D, ff=V), "fp8_current",
                            example_input=TOKENS)
  assert wide(report) == ["output_layer"]
  assert len(report.converted) == 4
  # Without an example, shapes cannot tell: said, and nothing guessed.
  report = qlayers.quantize(MiniGPT(V, D, ff=V), "fp8_current")
  assert "undecided" in report.head and "example_input" in report.head
  assert wide(report) == []


def test_fused_qkv_as_wide_as_the_vocabulary_is_converted():
  model = MiniGPT(3 * D, D, ff=2 * D, fused=True)
  report = qlayers.quantize(model, "fp8_current", example_input=TOKENS)
  assert wide(report) == ["output_layer"]
  assert "blocks/0/qkv" in converted(report)
  assert type(model.blocks[1].qkv) is qlayers.QuantDense
  # Without an example the QKV is not taken for "the vocabulary".
  report = qlayers.quantize(MiniGPT(3 * D, D, ff=2 * D, fused=True),
                            "fp8_current")
  assert wide(report) == [] and "undecided" in report.head


def test_unique_vocabulary_projection_found_by_shape():
  report = qlayers.quantize(MiniGPT(V, D, ff=2 * D), "fp8_current")
  assert wide(report) == ["output_layer"]
  assert "N=96 is the vocabulary of the embedding (96 x 32), found by shape" \
      in report.kept_wide[0].why
  assert report.head.endswith("output_layer")


class Tied(nnx.Module):

  def __init__(self, rngs):
    self.tok = nnx.Embed(V, D, rngs=rngs)
    self.fc = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, tokens):
    return self.tok.attend(nnx.relu(self.fc(self.tok(tokens))))


def test_tied_embedding_head_is_listed():
  model = Tied(nnx.Rngs(0))
  report = qlayers.quantize(model, "fp8_current", example_input=TOKENS)
  assert [(k.path, k.layer_type) for k in report.kept_wide] == [
      ("tok", "Embed")]
  assert "tied: the model's output is a projection" in report.kept_wide[0].why
  assert converted(report) == ["fc"] and type(model.tok) is nnx.Embed


class Encoder(nnx.Module):
  """Residual blocks and no head: the output is the residual stream."""

  def __init__(self, rngs):
    self.blocks = nnx.List([Block(D, 2 * D, rngs) for _ in range(2)])

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return x


def test_residual_encoder_has_no_head():
  report = qlayers.quantize(Encoder(nnx.Rngs(0)), "fp8_current",
                            example_input=X)
  assert wide(report) == [] and len(report.converted) == 4
  assert report.head.startswith("by tracing example_input: none found")


class ScanToy(nnx.Module):
  """Flax's scan example: Linear + BatchNorm stacked with nnx.vmap, applied
  with nnx.scan, then a head."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Layer(rngs)
    self.layers = make(rngs)
    self.head = nnx.Linear(D, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return layer(x)
    return self.head(body(self.layers, x))


class Layer(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(D, D, rngs=rngs)
    self.bn = nnx.BatchNorm(D, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.bn(self.linear(x)))


def test_stacked_batchnorm_not_reported_and_stacked_linear_not_a_head():
  model = ScanToy(nnx.Rngs(0))
  assert model.layers.bn.scale.shape == (3, D)
  report = qlayers.quantize(model, "fp8_current", rules=[
      qlayers.convert.KEEP_HEAD_WIDE], example_input=X)
  assert report.skipped == []
  assert converted(report) == ["layers/linear"]
  assert wide(report) == ["head"] and "by tracing" in report.kept_wide[0].why


def test_tracing_error_names_the_example():
  with pytest.raises(ValueError, match=r"example_input \(shapes \(\(2, 7\),"
                     r"\)\).*failed"):
    qlayers.quantize(ClassifierFirst(nnx.Rngs(0)), "fp8_current",
                     example_input=jnp.ones((2, 7)))


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_head_already_quantized_is_still_found(recipe):
  # Its GEMM is recognised through the quantization of its kernel, and the
  # input's amax scaling its output does not make the layer before a head.
  model = ClassifierFirst(nnx.Rngs(0))
  qlayers.quantize(model, None, qlayers.Rule(pattern="score", recipe=recipe))
  report = qlayers.quantize(model, recipe, example_input=X)
  assert report.head == "by tracing example_input: score"
  assert converted(report) == ["mid", "up"] and wide(report) == []


class QuantizedScore(nnx.Module):
  """A head the user quantized already, fed by two stock layers."""

  def __init__(self, recipe, rngs):
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)
    self.score = qlayers.QuantDense(D, D, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.score(nnx.relu(self.down(nnx.relu(self.up(x)))))


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp4", "nvfp4"])
def test_a_quantized_head_is_found_whatever_its_gemm_runs(recipe):
  # The 4-bit packing hid the head's weight from the flow: ``down`` was
  # taken for the head and kept wide.
  model = QuantizedScore(recipe, nnx.Rngs(0))
  report = qlayers.quantize(model, "fp8_current", example_input=X)
  assert report.head == "by tracing example_input: score"
  assert converted(report) == ["down", "up"] and wide(report) == []


def test_heads_are_traced_inside_an_intercept_block_too():
  # The plain-GEMM intercept of the trace refused to nest, and the error
  # blamed the model.
  model = ClassifierFirst(nnx.Rngs(0))
  with qlayers.ops.intercept(lambda site, *a, **k: None):
    report = qlayers.quantize(model, "fp8_current", example_input=X)
  assert wide(report) == ["score"] and converted(report) == ["mid", "up"]
