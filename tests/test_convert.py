"""Model conversion: which layers are swapped, Params kept, rules and their
report, the inverse, the LinearGeneral/Einsum drop-ins, training after."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers

D, V = 64, 64


class MLP(nnx.Module):

  def __init__(self, d, rngs):
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):

  def __init__(self, d, rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d,
                                       decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp = MLP(d, rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class LM(nnx.Module):
  """A small transformer from stock NNX layers only."""

  def __init__(self, n_blocks=1, seed=0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.blocks = nnx.List([Block(D, rngs) for _ in range(n_blocks)])
    self.ln_f = nnx.LayerNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


TOKENS = jax.random.randint(jax.random.key(0), (4, 16), 0, V)
ATTN = ("query", "key", "value", "out")


@nnx.jit
def apply(model, *args):
  """``model(*args)``, compiled once per model structure and recipe."""
  return model(*args)


def np_normal(std, seed=0):
  """An initializer drawing from NumPy: random init of a new shape in JAX
  compiles a program, which dominates small tests."""
  rng = np.random.default_rng(seed)
  return lambda key, shape, dtype: (std * rng.standard_normal(shape)).astype(
      dtype)


def block_paths(n_blocks):
  return sorted([f"blocks/{i}/attn/{p}" for i in range(n_blocks)
                 for p in ATTN]
                + [f"blocks/{i}/mlp/{p}" for i in range(n_blocks)
                   for p in ("up", "down")])


def param_objects(model):
  return {path: node for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Param)}


def assert_same_params(before, model):
  after = param_objects(model)
  assert after.keys() == before.keys()
  for path, var in before.items():
    assert after[path] is var, path


def assert_trees_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------
# Default conversion


def test_default_rules_convert_blocks_keep_embed_and_head_wide():
  model = LM(n_blocks=2)
  before = param_objects(model)
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  report = qlayers.quantize(model, "fp8_delayed")

  assert [c.path for c in report.converted] == block_paths(2)
  assert all(c.recipe == "fp8_delayed" and c.rule is None
             for c in report.converted)
  assert [(k.path, k.rule) for k in report.kept_wide] == [
      ("head", qlayers.convert.DEFAULT_KEEP_WIDE)]
  assert report.skipped == [] and report.unmatched_rules == []
  assert report.model is model
  for b in model.blocks:
    for p in ATTN:
      assert type(getattr(b.attn, p)) is qlayers.QuantLinearGeneral
    assert type(b.mlp.up) is qlayers.QuantDense
    assert type(b.mlp.down) is qlayers.QuantDense
    assert isinstance(b.mlp.up.quant, qlayers.QuantGemm)
  assert type(model.head) is nnx.Linear
  assert type(model.embed) is nnx.Embed
  # Shapes in the report are the GEMM's (K, N).
  shapes = {c.path: c.shape for c in report.converted}
  assert shapes["blocks/0/attn/query"] == (D, D)
  assert shapes["blocks/0/mlp/down"] == (2 * D, D)

  # The very same Param objects, values untouched, same Param state.
  assert_same_params(before, model)
  assert_trees_equal(params, nnx.state(model, nnx.Param))

  text = str(report)
  assert "12 converted" in text and "DEFAULT_KEEP_WIDE" in text
  assert "blocks/1/attn/out" in text and "LinearGeneral -> QuantLinearGeneral"\
      in text


def test_outputs_close_to_unquantized(sqnr):
  model = LM(n_blocks=1)
  ref = apply(model, TOKENS)
  qlayers.quantize(model, "fp8_delayed")
  got = apply(model, TOKENS)
  assert got.shape == ref.shape
  assert sqnr(ref, got) > 20


def test_default_keep_wide_pattern():
  wide = ["embed", "tok_embed", "embedding", "model/pos_embed", "lm_head",
          "head", "decoder/logits", "unembed", "output", "wte", "head/dense",
          "classifier", "bert/classifier"]
  narrow = ["blocks/0/mlp/up", "blocks/0/attn/out", "layers/3/output/dense",
            "headless", "blocks/0/attn/heads", "proj", "classifier_proj"]
  rule = qlayers.convert.DEFAULT_RULES[0]
  assert rule.recipe is None
  assert [p for p in wide if not rule.matches(p)] == []
  assert [p for p in narrow if rule.matches(p)] == []


# ----------------------------------------------------------------------------
# Rules


def test_rules_per_recipe_first_match_wins_and_unmatched_reported():
  model = LM(n_blocks=2)
  rules = [
      qlayers.Rule(pattern=r"/attn/", recipe="mxfp8"),
      qlayers.Rule(pattern=r"^blocks/1/mlp/down$", recipe=None),
      qlayers.Rule(pattern=r"/mlp/", recipe="fp8_delayed"),
      qlayers.Rule(pattern=r"mlp/up", recipe="mxfp4"),       # shadowed
      qlayers.Rule(pattern=r"cross_attn", recipe="mxfp8"),   # matches nothing
  ]
  report = qlayers.quantize(model, None, rules)

  recipes = {c.path: (c.recipe, c.rule) for c in report.converted}
  assert recipes["blocks/0/attn/value"] == ("mxfp8", r"/attn/")
  assert recipes["blocks/1/mlp/up"] == ("fp8_delayed", r"/mlp/")
  assert model.blocks[1].attn.out.recipe.name == "mxfp8"
  assert model.blocks[0].mlp.down.recipe.name == "fp8_delayed"
  assert not nnx.state(model.blocks[1].attn.query.quant)  # MX: no state
  assert type(model.blocks[1].mlp.down) is nnx.Linear
  assert {(k.path, k.rule) for k in report.kept_wide} == {
      ("blocks/1/mlp/down", r"^blocks/1/mlp/down$"),
      ("head", None)}  # no rule and no default recipe
  assert [r.pattern for r in report.unmatched_rules] == [r"mlp/up",
                                                         r"cross_attn"]
  assert "rules that matched nothing" in str(report)
  assert "'cross_attn'" in str(report)


def test_strict_raises_on_unmatched_rule_and_changes_nothing():
  model = LM(n_blocks=1)
  before = param_objects(model)
  rules = [qlayers.Rule(pattern=r"/mlp/", recipe="fp8_delayed"),
           qlayers.Rule(pattern=r"^decoder/", recipe="mxfp8"),
           *qlayers.convert.DEFAULT_RULES]
  with pytest.raises(ValueError, match=r"decide no layer.*\^decoder/"):
    qlayers.quantize(model, "fp8_current", rules, strict=True)
  assert type(model.blocks[0].mlp.up) is nnx.Linear
  assert_same_params(before, model)
  # The built-in default rule is exempt, and not reported: nothing here is
  # called "head".
  model = nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)))
  report = qlayers.quantize(model, "fp8_current", strict=True)
  assert [c.path for c in report.converted] == ["layers/0"]
  assert report.unmatched_rules == []
  assert "matched nothing" not in str(report)


def test_skip_by_dimension():
  model = LM(n_blocks=1)
  report = qlayers.quantize(model, "deepseek_v3")  # 128-element tiles
  assert report.converted == []
  assert [s.path for s in report.skipped] == block_paths(1)
  up = next(s for s in report.skipped if s.path == "blocks/0/mlp/up")
  assert up.reason.startswith("K=64, N=128: smaller than one 128-element")
  assert "deepseek_v3" in up.reason

  class Narrow(nnx.Module):
    def __init__(self, rngs):
      self.wide = nnx.Linear(64, 64, rngs=rngs)
      self.gate = nnx.Linear(64, 16, rngs=rngs)
  net = Narrow(nnx.Rngs(0))
  report = qlayers.quantize(net, "mxfp8", rules=())  # gate is also the head
  assert [c.path for c in report.converted] == ["wide"]
  assert [(s.path, s.reason[:12]) for s in report.skipped] == [
      ("gate", "K=64, N=16: ")]
  assert "32-element mx scaling block" in report.skipped[0].reason
  # Per-tensor scaling takes any size.
  report = qlayers.quantize(Narrow(nnx.Rngs(0)), "fp8_current", rules=())
  assert len(report.converted) == 2


def test_already_quantized_left_alone():
  model = LM(n_blocks=1)
  qlayers.quantize(model, "fp8_delayed")
  up = model.blocks[0].mlp.up
  with pytest.warns(UserWarning, match="quantized already with another"):
    report = qlayers.quantize(model, "mxfp8",
                              [qlayers.Rule(pattern="mlp", recipe="mxfp8")])
  assert model.blocks[0].mlp.up is up and up.recipe.name == "fp8_delayed"
  assert [c.path for c in report.converted] == ["head"]  # explicit rules
  assert ("blocks/0/mlp/up", "already quantized (fp8_delayed); not "
          "requantized as mxfp8 (dequantize_model first)") in [
              (s.path, s.reason) for s in report.already_quantized]
  assert report.unmatched_rules == []  # it matched, though nothing changed


# ----------------------------------------------------------------------------
# The inverse


def test_dequantize_round_trip_restores_stock_layers_exactly():
  model = LM(n_blocks=1)
  ref = apply(model, TOKENS)
  before = param_objects(model)
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  stock_types = {p: type(n) for p, n in nnx.iter_graph(model)
                 if isinstance(n, nnx.Module)}
  qlayers.quantize(model, "fp8_delayed")
  apply(model, TOKENS)  # quantization state now differs from fresh
  report = qlayers.dequantize_model(model)

  assert [c.path for c in report.converted] == block_paths(1)
  assert {c.recipe for c in report.converted} == {"fp8_delayed"}
  assert {p: type(n) for p, n in nnx.iter_graph(model)
          if isinstance(n, nnx.Module)} == stock_types
  assert nnx.state(model, qlayers.QuantVariable) == nnx.State({})
  assert_same_params(before, model)
  assert_trees_equal(params, nnx.state(model, nnx.Param))
  np.testing.assert_array_equal(np.asarray(apply(model, TOKENS)),
                                np.asarray(ref))
  assert model.blocks[0].attn.query.axis == (-1,)
  assert model.blocks[0].attn.out.axis == (-2, -1)


def test_not_inplace_converts_a_copy():
  model = LM(n_blocks=1)
  report = qlayers.quantize(model, "fp8_current", inplace=False)
  assert type(model.blocks[0].mlp.up) is nnx.Linear
  copy = report.model
  assert copy is not model and type(copy.blocks[0].mlp.up) is qlayers.QuantDense
  assert copy.blocks[0].mlp.up.kernel is not model.blocks[0].mlp.up.kernel
  back = qlayers.dequantize_model(copy, inplace=False)
  assert type(back.model.blocks[0].mlp.up) is nnx.Linear
  assert type(copy.blocks[0].mlp.up) is qlayers.QuantDense


# ----------------------------------------------------------------------------
# Where layers live: containers, shared layers, stacked layers


def test_containers_shared_and_unswappable():
  rngs = nnx.Rngs(0)
  lin = lambda: nnx.Linear(D, D, rngs=rngs)

  class Net(nnx.Module):
    def __init__(self):
      self.plain_list = nnx.data([lin(), lin()])
      self.plain_dict = nnx.data({"a": lin()})
      self.nlist = nnx.List([lin()])
      self.ndict = nnx.Dict(b=lin())
      self.tup = nnx.data((lin(),))
      self.seq = nnx.Sequential(lin())
      self.shared = self.nlist[0]

  net = Net()
  kernel = net.nlist[0].kernel
  report = qlayers.quantize(net, "fp8_current")
  assert sorted(c.path for c in report.converted) == [
      "ndict/b", "nlist/0", "plain_dict/a", "plain_list/0", "plain_list/1",
      "seq/layers/0"]
  assert all(type(m) is qlayers.QuantDense for m in
             (*net.plain_list, net.plain_dict["a"], net.nlist[0],
              net.ndict["b"], net.seq.layers[0]))
  # A shared layer is swapped everywhere, still shared, same kernel.
  assert net.shared is net.nlist[0] and net.shared.kernel is kernel
  shared = next(c for c in report.converted if c.path == "nlist/0")
  assert shared.aliases == ("shared",)
  # A tuple cannot be changed in place.
  assert [(s.path, "immutable tuple" in s.reason) for s in report.skipped] \
      == [("tup/0", True)]
  # The model itself cannot be swapped for its own parent.
  report = qlayers.quantize(lin(), "fp8_current")
  assert [s.path for s in report.skipped] == [""]
  assert "(model)" in str(report)


def test_a_rule_naming_any_path_of_a_shared_layer_decides_it():
  # Rules saw only a shared layer's first path (sorted): one naming the
  # other was "matched nothing" (strict: an error), and a layer tied as
  # lm_head under another name was quantized by the default rules.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.decoder_proj = nnx.Linear(D, D, rngs=rngs)
      self.encoder_proj = self.decoder_proj
      self.in_proj = nnx.Linear(D, D, rngs=rngs)
      self.lm_head = self.in_proj

  net = Net(nnx.Rngs(0))
  report = qlayers.quantize(net, "fp8_current", strict=True, rules=[
      qlayers.Rule(pattern=r"^encoder_proj$", recipe=None),
      *qlayers.convert.DEFAULT_RULES])
  assert type(net.encoder_proj) is nnx.Linear  # kept wide by its rule
  assert type(net.lm_head) is nnx.Linear  # kept wide by DEFAULT_KEEP_WIDE
  assert not report.converted and not report.unmatched_rules
  # The report names the path the rule matched too.
  assert "in_proj (= lm_head)" in str(report)
  assert "decoder_proj (= encoder_proj)" in str(report)


class Stacked(nnx.Module):
  """Three Linear layers made under nnx.vmap, applied with nnx.scan."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Linear(D, D, rngs=rngs)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return jax.nn.tanh(layer(x))
    return body(self.layers, x)


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "nvfp4"])
def test_stacked_layers_convert_with_per_layer_state(recipe, sqnr):
  x = jax.random.normal(jax.random.key(1), (8, D))
  model = Stacked(nnx.Rngs(0))
  assert model.layers.kernel.shape == (3, D, D)
  ref = apply(model, x)
  report = qlayers.quantize(model, recipe)
  assert [c.path for c in report.converted] == ["layers"]
  assert type(model.layers) is qlayers.QuantDense
  assert sqnr(ref, apply(model, x)) > (9 if recipe == "nvfp4" else 20)
  if recipe == "nvfp4":
    # Stochastic rounding keyed per stacked layer: its own seed and counter.
    s = model.layers.quant
    assert s.sr_seed.shape == s.sr_step.shape == (3,)
    assert len(set(np.asarray(s.sr_seed[...]).tolist())) == 3
  if recipe == "fp8_delayed":
    # One delayed-scaling state per stacked layer, each seeing its own input.
    s = model.layers.quant
    assert s.x_amax_history.shape == (3, 1024) and s.x_amax.shape == (3,)
    amax = np.asarray(s.x_amax[...])
    assert np.all(amax > 0) and len(set(amax.tolist())) == 3
    qlayers.update_scales(model)
    np.testing.assert_allclose(s.x_amax_history[...][:, 0], amax)


# ----------------------------------------------------------------------------
# LinearGeneral / Einsum drop-ins


def test_linear_general_and_einsum_are_one_gemm(sqnr):
  x = jax.random.normal(jax.random.key(2), (2, 3, 4, 16))
  init = dict(kernel_init=np_normal(0.2), bias_init=np_normal(1.0),
              rngs=nnx.Rngs(0))
  cases = [
      (nnx.LinearGeneral((4, 16), 8, axis=(-2, -1), **init), x),
      (nnx.LinearGeneral((3, 16), (2, 5), axis=(1, 3), **init), x),
      (nnx.Einsum("btd,dnh->bnth", (16, 4, 8), (4, 8), **init), x[0]),
      (nnx.Einsum("...hd,hdo->...o", (4, 16, 8), (8,), **init), x),
  ]
  for stock, inp in cases:
    ref = stock(inp)
    holder = nnx.Sequential(stock)
    qlayers.quantize(holder, "fp8_current")
    q = holder.layers[0]
    assert type(q).__name__ in ("QuantLinearGeneral", "QuantEinsum")
    got = apply(q, inp)
    assert got.shape == ref.shape and sqnr(ref, got) > 25, stock

    # Exactly the 2-D GEMM QuantDense runs on the flattened operands.
    if isinstance(q, nnx.LinearGeneral) and q.axis == (-2, -1):
      dense = qlayers.QuantDense(64, 8, recipe="fp8_current", **init)
      dense.kernel[...] = q.kernel[...].reshape(64, 8)
      dense.bias[...] = q.bias[...]
      want = apply(dense, inp.reshape(2, 3, 64))
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unconvertible_general_layers_are_skipped_with_reasons():
  rngs = nnx.Rngs(0)

  class Net(nnx.Module):
    def __init__(self):
      self.batched = nnx.Einsum("bd,hbd->bh", (64, 2, 64), rngs=rngs)
      self.grouped = nnx.LinearGeneral(64, 64, batch_axis={0: 2}, rngs=rngs)
      self.custom = nnx.Linear(
          64, 64, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
          rngs=rngs)
      self.lora = nnx.LoRALinear(64, 64, lora_rank=2, rngs=rngs)
      self.ok = nnx.Einsum("btd,dh->bth", (64, 64), rngs=rngs)

  net = Net()
  report = qlayers.quantize(net, "fp8_current")
  assert [c.path for c in report.converted] == ["ok"]
  assert type(net.ok) is qlayers.QuantEinsum
  reasons = {s.path: s.reason for s in report.skipped}
  assert "batch dims" in reasons["batched"]
  assert "batch_axis" in reasons["grouped"]
  assert "custom dot_general" in reasons["custom"]
  assert "subclass of nnx.Linear" in reasons["lora"]


# ----------------------------------------------------------------------------
# Bad input


def test_bad_input_errors():
  model = LM(n_blocks=1)
  with pytest.raises(TypeError, match="nnx.Module"):
    qlayers.quantize({"not": "a module"}, "fp8_delayed")
  with pytest.raises(ValueError, match="Unknown recipe 'fp9'.*available"):
    qlayers.quantize(model, "fp9")
  with pytest.raises(ValueError, match="not a valid regular expression"):
    qlayers.Rule(pattern="blocks/(", recipe="mxfp8")
  with pytest.raises(ValueError, match="Unknown recipe"):
    qlayers.Rule(pattern="mlp", recipe="mxfp9")
  with pytest.raises(ValueError, match="backend"):
    qlayers.Rule(pattern="mlp", recipe="mxfp8", backend="cuda")
  with pytest.raises(TypeError, match="Rule"):
    qlayers.quantize(model, None, [("mlp", "mxfp8")])
  with pytest.raises(TypeError, match="nnx.Module"):
    qlayers.dequantize_model([model])
  assert type(model.blocks[0].mlp.up) is nnx.Linear


# ----------------------------------------------------------------------------
# Training after conversion


def _loss(model, tokens):
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean()


@nnx.jit
def _train_step(model, opt, tokens):
  loss, grads = qlayers.value_and_grad(_loss)(model, tokens)
  opt.update(model, grads)
  return loss


def test_converted_model_trains():
  model = LM(n_blocks=1)
  # An optimizer built before the conversion keeps working: same Params.
  opt = qlayers.Optimizer(model, optax.adam(1e-2))
  qlayers.quantize(model, qlayers.recipe("fp8_delayed", amax_history_len=16))
  tokens = TOKENS[:2, :9]
  losses = [float(_train_step(model, opt, tokens)) for _ in range(4)]
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses
  hist = model.blocks[0].mlp.up.quant.x_amax_history[...]
  assert hist.shape == (16,) and float(hist[0]) > 0 and float(hist[3]) > 0
  assert int(opt.step[...]) == 4


# ----------------------------------------------------------------------------
# Output heads by what they are, unconvertible matmuls, tied embeddings


class MiniGPT(nnx.Module):
  """Heads named as third-party models name them: the vocabulary projection
  ``output_layer`` and a fused ``c_attn`` whose N (3d) is no layer's K."""

  def __init__(self, head_name="output_layer", vocab=1000, d=64):
    rngs = nnx.Rngs(0)
    self.token_emb = nnx.Embed(vocab, d, rngs=rngs)
    self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
    self.c_proj = nnx.Linear(d, d, rngs=rngs)
    self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
    self.fc_out = nnx.Linear(4 * d, d, rngs=rngs)
    setattr(self, head_name, nnx.Linear(d, vocab, rngs=rngs))


class ViT(nnx.Module):

  def __init__(self, d=64, classes=10):
    rngs = nnx.Rngs(0)
    self.patch = nnx.Conv(3, d, (4, 4), strides=(4, 4), rngs=rngs)
    self.mlp_in = nnx.Linear(d, 2 * d, rngs=rngs)
    self.mlp_out = nnx.Linear(2 * d, d, rngs=rngs)
    self.classifier = nnx.Linear(d, classes, rngs=rngs)

  def __call__(self, images):
    x = self.patch(images).mean(axis=(1, 2))
    return self.classifier(x + self.mlp_out(nnx.gelu(self.mlp_in(x))))


@pytest.mark.parametrize("name", ["output_layer", "score", "fc_vocab"])
def test_vocabulary_head_kept_wide_whatever_its_name(name):
  model = MiniGPT(name)
  report = qlayers.quantize(model, "fp8_current")
  assert [k.path for k in report.kept_wide] == [name]
  assert "vocabulary of the embedding (1000 x 64)" in report.kept_wide[0].why
  assert "output head" in str(report)
  assert sorted(c.path for c in report.converted) == [
      "c_attn", "c_proj", "fc", "fc_out"]


def test_classifier_kept_wide_and_conv_reported():
  images = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
  report = qlayers.quantize(ViT(), "mxfp8", example_input=images)
  assert [k.path for k in report.kept_wide] == ["classifier"]
  assert "found by tracing example_input" in report.kept_wide[0].why
  # Without an example, by name (no embedding: no head by shape).
  report = qlayers.quantize(ViT(), "mxfp8")
  assert [(k.path, k.rule) for k in report.kept_wide] == [
      ("classifier", qlayers.convert.DEFAULT_KEEP_WIDE)]
  assert [(s.path, s.layer_type) for s in report.skipped] == [
      ("patch", "Conv")]
  assert "convolution" in report.skipped[0].reason
  # Explicit rules replace the defaults: the classifier is converted.
  report = qlayers.quantize(ViT(), "fp8_current", rules=())
  assert "classifier" in [c.path for c in report.converted]


def test_hand_written_linear_is_reported_not_passed_over():
  class ShardedLinear(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 64)))

    def __call__(self, x):
      return jnp.matmul(x, self.w[...])

  class Net(nnx.Module):
    def __init__(self):
      rngs = nnx.Rngs(0)
      self.pos_emb = nnx.Param(jnp.zeros((16, 64)))  # a table, not a matmul
      self.norm = nnx.LayerNorm(64, rngs=rngs)
      self.proj = ShardedLinear(rngs)
      self.up = nnx.Linear(64, 64, rngs=rngs)

  report = qlayers.quantize(Net(), "fp8_current")
  assert [c.path for c in report.converted] == ["up"]
  (s,) = report.skipped
  assert (s.path, s.layer_type) == ("proj", "ShardedLinear")
  assert "not a recognised linear layer" in s.reason
  assert "'w' of shape (64, 64)" in s.reason and "QuantGemm" in s.reason


class TiedGPT(nnx.Module):

  def __init__(self, vocab=256, d=64):
    rngs = nnx.Rngs(0)
    self.wte = nnx.Embed(vocab, d, rngs=rngs)
    self.mlp = MLP(d, rngs)

  def __call__(self, tokens):
    x = self.wte(tokens)
    return self.wte.attend(x + self.mlp(x))


def test_tied_embedding_head_quantized_by_opt_in_rule(sqnr):
  model = TiedGPT()
  table = model.wte.embedding
  ref = apply(model, TOKENS)
  # By default the embedding (and so its attend) stays wide.
  report = qlayers.quantize(model, "fp8_current")
  assert type(model.wte) is nnx.Embed
  assert "wte" not in [c.path for c in report.converted]
  rules = [qlayers.Rule(pattern=r"(^|/)wte$", recipe="fp8_current"),
           *qlayers.convert.DEFAULT_RULES]
  report = qlayers.quantize(model, None, rules)
  assert [(c.path, c.new_type) for c in report.converted] == [
      ("wte", "QuantEmbed")]
  assert model.wte.embedding is table  # the same Param
  got = apply(model, TOKENS)
  assert sqnr(ref, got) > 20
  # Lookups are untouched; gradients reach the table through attend.
  np.testing.assert_array_equal(model.wte(TOKENS), table[...][TOKENS])
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(TOKENS)[..., 7])))(model)
  g = np.asarray(grads["wte"]["embedding"][...])
  assert np.abs(g[7]).sum() > 0
  qlayers.dequantize_model(model)
  assert type(model.wte) is nnx.Embed and model.wte.embedding is table


def test_quantize_warns_when_layers_keep_another_recipe():
  # The README's flow quantized a model already quantized: nothing changed
  # and nothing said so.
  # The report says so; a rule naming the recipe warns (a default recipe
  # does not: a model may hold layers built with their own recipes).
  model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
  qlayers.quantize(model, "fp8_delayed", rules=())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    report = qlayers.quantize(model, "mxfp4", rules=())
    qlayers.quantize(model, None, [qlayers.Rule(pattern=".*", recipe="fp8_delayed")])
  assert "not requantized as mxfp4" in report.already_quantized[0].reason
  with pytest.warns(UserWarning, match="dequantize_model"):
    qlayers.quantize(model, None, [qlayers.Rule(pattern=".*", recipe="mxfp4")])
  assert model.layers[0].recipe.name == "fp8_delayed"


def test_a_rule_takes_a_recipe_path():
  # Its message said paths were taken; a pathlib.Path was refused.
  import pathlib
  path = pathlib.Path(qlayers.__file__).parent.parent / "recipes/mxfp8.toml"
  rule = qlayers.Rule(pattern="up", recipe=path)
  assert rule.recipe == str(path)
