"""qlayers.integrations.tunix: Tunix models converted, Tunix's trainer with
delayed scaling. Skipped when google-tunix is not installed
(``pip install --no-deps -r examples/requirements-tunix.txt``)."""

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="google-tunix is not installed "
                    "(pip install --no-deps -r examples/requirements-tunix.txt)")

# pylint: disable=g-import-not-at-top,wrong-import-position
import qlayers
from qlayers.integrations import tunix as qtunix
from tunix.models.llama3 import model as llama3
from tunix.models.qwen3 import model as qwen3
from tunix.sft import peft_trainer, utils

# Tunix builds its Params with Flax's deprecated `sharding=` metadata and
# reads JAX's deprecated pxla.thread_resources; its step optax.global_norm.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:optax.global_norm is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:'sharding' is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning")]

EQUATIONS = (("BTD,DNH->BTNH", (32, 2, 16)), ("BTNH,NHD->BTD", (2, 16, 32)))


def _tunix_einsum(eq, shape, seed=0):
  return qwen3.Einsum(eq, shape, rngs=nnx.Rngs(seed), sharding=(None,) * 3,
                      dtype=jnp.float32, param_dtype=jnp.float32)


def _input(eq, seed=1):
  shape = {"BTD": (2, 3, 32), "BTNH": (2, 3, 2, 16)}[eq.split(",")[0]]
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("eq,shape", EQUATIONS)
def test_einsum_is_qlayers_einsum_on_tunix_w(eq, shape):
  layer = _tunix_einsum(eq, shape)
  q = qtunix.QuantTunixEinsum.from_tunix(layer, "fp8_current")
  assert q.w is layer.w and q.kernel_shape == shape
  ref = qlayers.QuantEinsum(eq.lower(), shape, recipe="fp8_current",
                            rngs=nnx.Rngs(0))
  ref.kernel.set_value(layer.w[...])
  x = _input(eq)
  np.testing.assert_array_equal(q(x), ref(x))  # same GEMM, same bits
  wide = layer(x)
  err = jnp.linalg.norm(wide - q(x)) / jnp.linalg.norm(wide)
  assert 0 < err < 0.1  # quantized, and close


@pytest.mark.parametrize("eq,shape", EQUATIONS)
def test_lora_starts_at_zero_and_adds_x_a_b(eq, shape):
  q = qtunix.QuantTunixEinsum.from_tunix(_tunix_einsum(eq, shape),
                                         "fp8_current")
  x = _input(eq)
  before = q(x)
  assert qtunix.add_lora(q, 4, rngs=nnx.Rngs(2)) == 1
  np.testing.assert_array_equal(q(x), before)  # lora_b starts at zero
  q.lora_b.set_value(jax.random.normal(jax.random.key(3), q.lora_b.shape))
  k = q.lora_a.shape[:-1]
  delta = (q.lora_a[...].reshape(-1, 4) @ q.lora_b[...].reshape(4, -1))
  expect = before + jnp.einsum(eq, x, delta.reshape(shape))
  assert q.lora_a.shape == (*k, 4) and isinstance(q.lora_a, nnx.LoRAParam)
  np.testing.assert_allclose(q(x), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq,shape", EQUATIONS + (("BTD,NDH->BTNH",
                                                     (2, 32, 16)),))
def test_merged_adapters_fold_into_w_laid_out_as_it_is(eq, shape):
  # qlayers.merge_lora skipped these adapters in silence (none merged, none
  # named), and no function merged them.
  q = qtunix.QuantTunixEinsum.from_tunix(_tunix_einsum(eq, shape),
                                         "fp8_delayed")
  model = nnx.Dict(attn=nnx.Dict(q_proj=q))
  qtunix.add_lora(model, 4, rngs=nnx.Rngs(2))
  q.lora_b.set_value(jax.random.normal(jax.random.key(3), q.lora_b.shape))
  x = _input(eq)
  q.eval()
  before, w, b = q(x), q.w[...], q.lora_b[...]
  q.lora_b.set_value(jnp.zeros_like(b))
  adapter = before - q(x)  # x @ a @ b as the forward adds it
  q.lora_b.set_value(b)
  with pytest.warns(UserWarning, match=r"attn\.q_proj\.lora_a.*tunix"):
    assert qlayers.merge_lora(model) == 0
  assert qtunix.merge_lora(model) == 1 and q.lora_a is None
  assert not nnx.state(model, nnx.LoRAParam)
  np.testing.assert_allclose(jnp.einsum(eq, x, q.w[...]),
                             jnp.einsum(eq, x, w) + adapter,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(q.quant.w_amax[...],
                                jnp.max(jnp.abs(q.w[...])))
  err = jnp.linalg.norm(q(x) - before) / jnp.linalg.norm(before)
  assert err < 0.1  # the same function, quantized from the merged w


def _qwen3(seed=0):
  cfg = qwen3.ModelConfig(
      num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2,
      head_dim=16, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6,
      use_tied_embedding=False)
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
  # Tunix initialises the MLP kernels to zero (checkpoints overwrite them).
  key = jax.random.key(seed + 1)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, nnx.Linear):
      key, sub = jax.random.split(key)
      m.kernel.set_value(jax.random.normal(sub, m.kernel.shape)
                         * m.in_features ** -0.5)
  return model


def test_quantize_converts_attention_einsums_and_mlps():
  model = _qwen3()
  report = qtunix.quantize(model, "fp8_delayed")
  paths = {c.path: c.new_type for c in report.converted}
  assert paths == {
      **{f"layers/0/attn/{p}_proj": "QuantTunixEinsum" for p in "qkvo"},
      **{f"layers/0/mlp/{p}_proj": "QuantDense"
         for p in ("gate", "up", "down")}}
  assert [k.path for k in report.kept_wide] == ["lm_head"]
  assert not report.skipped and not report.already_quantized
  q = model.layers[0].attn.q_proj
  assert isinstance(q, qtunix.QuantTunixEinsum) and q.recipe.name == (
      "fp8_delayed")
  assert "Einsum -> QuantTunixEinsum" in str(report)


def test_quantize_gives_every_gemm_its_own_rounding_seed():
  # The drop-ins are built as size-1 twins, whose seeds are all alike: a
  # stochastic-rounding recipe must not draw the same bits in every layer.
  cfg = qwen3.ModelConfig(
      num_layers=2, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2,
      head_dim=16, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6,
      num_experts=2, num_experts_per_tok=1)
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  qtunix.quantize(model, "nvfp4")
  seeds = {"/".join(map(str, p)): np.ravel(g.sr_seed[...]).tolist()
           for p, g in qlayers.layers.core.gemms(model)}
  assert len(seeds) == 2 * (4 + 3)  # q, k, v, o einsums; three expert GEMMs
  firsts = [s[0] for s in seeds.values()]
  assert len(set(firsts)) == len(firsts), seeds
  a, b = (_tunix_einsum(*EQUATIONS[0], seed=s) for s in (0, 1))
  qa, qb = (qtunix.QuantTunixEinsum.from_tunix(t, "nvfp4") for t in (a, b))
  assert int(qa.quant.sr_seed[...]) != int(qb.quant.sr_seed[...])


@pytest.fixture
def tunix_numpy():
  """Tunix's models broadcast by rank (its RMSNorm) and optax.adam mixes
  float and int32: run them under NumPy's standard rules."""
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion(
      "standard"):
    yield


def test_quantize_llama3():
  cfg = llama3.ModelConfig(
      num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2,
      head_dim=16, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6)
  model = llama3.Llama3(cfg, rngs=nnx.Rngs(0))
  report = qtunix.quantize(model, "fp8_current")
  assert sorted(c.path for c in report.converted
                if c.new_type == "QuantTunixEinsum") == [
                    f"layers/0/attn/{p}_proj" for p in "koqv"]
  assert [k.path for k in report.kept_wide] == ["lm_head"]
  assert not report.skipped


def _loss(model, x):
  return jnp.mean((model(x) - 0.5 * x) ** 2)


def _trainer(cls, model, steps, **config):
  trainer = cls(model, optax.sgd(0.1), peft_trainer.TrainingConfig(
      eval_every_n_steps=100, max_steps=steps, pbar_description=None,
      **config))
  return trainer.with_loss_fn(_loss)


def _batches(n):
  return [{"x": jax.random.normal(jax.random.key(i), (4, 16)) * (i + 1)}
          for i in range(n)]


def test_stock_trainer_never_ends_a_delayed_step():
  """The failure the hook fixes: Tunix's own step loses the gradient amax
  and never rolls the histories."""
  model = qlayers.QuantDense(16, 16, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="without its gradient amax"):
    _trainer(peft_trainer.PeftTrainer, model, 3).train(_batches(3))
  assert not np.any(model.quant.x_amax_history[...])
  assert not np.any(model.quant.g_amax_history[...])


def test_trainer_steps_equal_the_qlayers_loop():
  """Each step of `PeftTrainer` is `qlayers.value_and_grad`, the optimizer
  update, then `qlayers.update_scales`; eval records nothing."""
  batches = _batches(3)
  model = qlayers.QuantDense(16, 16, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  trainer = _trainer(qtunix.PeftTrainer, model, 3)
  # A 6x eval batch (amax above every training batch's): recorded, it would
  # show in the first history entry.
  trainer.train(batches, eval_ds=[{"x": batches[0]["x"] * 6.0}])

  ref = qlayers.QuantDense(16, 16, recipe="fp8_delayed", rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(ref, opt, x):
    _, grads = qlayers.value_and_grad(_loss)(ref, x)
    amaxes, grads = nnx.split_state(grads, qlayers.QuantGradState, ...)
    opt.update(ref, grads)
    qlayers.update_scales(ref, amaxes)

  for b in batches:
    step(ref, opt, b["x"])
  got, want = nnx.state(model), nnx.state(ref)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               got, want)
  hist = model.quant.x_amax_history[...]
  amax = [float(jnp.max(jnp.abs(b["x"]))) for b in batches]
  np.testing.assert_allclose(hist[:3], amax[::-1], rtol=1e-6)
  assert np.all(model.quant.g_amax_history[:3] > 0)
  assert not np.any(hist[3:])


def _tokens(n_batches=1):
  rng = np.random.default_rng(0)
  return [{"input_tokens": jnp.asarray(rng.integers(1, 64, (4, 16)),
                                       jnp.int32)} for _ in range(n_batches)]


def _model_inputs(batch):
  mask = jnp.ones_like(batch["input_tokens"], dtype=jnp.bool_)
  return dict(input_tokens=batch["input_tokens"], input_mask=mask,
              positions=utils.build_positions_from_mask(mask),
              attention_mask=utils.make_causal_attn_mask(mask))


# LoRA under delayed scaling differentiates LoRAParams and the gradient
# amaxes together; full-weight SFT under delayed scaling is the loop above.
@pytest.mark.parametrize("recipe,lora", [("fp8_delayed", True),
                                         ("fp8_current", False)],
                         ids=["lora-fp8_delayed", "sft-fp8_current"])
def test_qwen3_trains_with_tunix(recipe, lora, tunix_numpy):
  del tunix_numpy
  model = _qwen3()
  qtunix.quantize(model, recipe)
  if lora:
    assert qtunix.add_lora(model, 4, rngs=nnx.Rngs(5)) == 4
  base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  frozen = nnx.clone(nnx.state(model, base))
  trainer = qtunix.PeftTrainer(
      model, optax.adam(3e-2 if lora else 1e-2),
      peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=6,
                                  pbar_description=None))
  trainer = trainer.with_gen_model_input_fn(_model_inputs)
  trainer.train(_tokens() * 6)
  losses = trainer.metrics_logger.get_metric_history("", "loss", "train")
  assert len(losses) == 6 and np.all(np.isfinite(losses))
  assert losses[-1] < 0.9 * losses[0], losses
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)),
                         nnx.state(model, base), frozen)
  assert any(jax.tree.leaves(changed)) == (not lora)  # LoRA: base frozen
  q = model.layers[0].attn.q_proj.quant
  if recipe == "fp8_delayed":
    assert np.all(q.x_amax_history[:6] > 0) and np.all(
        q.g_amax_history[:6] > 0)


def test_without_tunix_the_module_imports_and_says_what_to_install(
    monkeypatch):
  monkeypatch.setitem(sys.modules, "tunix.sft", None)  # import fails
  spec = importlib.util.spec_from_file_location("tunix_absent",
                                                qtunix.__file__)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.quantize and module.QuantTunixEinsum  # the rest works
  with pytest.raises(ImportError, match=r"qlayers\[tunix\]"):
    module.PeftTrainer(None, None, None)


def test_quantize_traces_a_tunix_model_for_its_head(tunix_numpy):
  # A QuantTunixEinsum holds its weight at .w: tracing with example_input
  # failed on its missing .kernel.
  del tunix_numpy
  model = _qwen3()
  i = _model_inputs(_tokens()[0])
  report = qtunix.quantize(model, "fp8_current", example_input=(
      i["input_tokens"], i["positions"], None, i["attention_mask"]))
  assert [k.path for k in report.kept_wide] == ["lm_head"]  # by name
  assert "by tracing example_input" in report.head


def test_an_einsum_holding_adapters_is_skipped_with_the_reason():
  # qwix's LoRA puts w_lora_a / w_lora_b beside w: the drop-in dropped them
  # and reported the layer converted.
  layer = _tunix_einsum(*EQUATIONS[0])
  layer.w_lora_a = nnx.LoRAParam(jnp.zeros((32, 2)))
  net = nnx.Dict(proj=layer)
  report = qtunix.quantize(net, "fp8_current")
  assert net.proj is layer and "w_lora_a" in report.skipped[0].reason
  assert "add_lora" in report.skipped[0].reason


def test_add_lora_refuses_nothing_to_adapt_and_keeps_trained_adapters():
  model = _qwen3()
  with pytest.raises(ValueError, match="quantize the model first"):
    qtunix.add_lora(model, 2, rngs=nnx.Rngs(0))
  qtunix.quantize(model, "fp8_current")
  assert qtunix.add_lora(model, 2, rngs=nnx.Rngs(0)) == 4
  q = model.layers[0].attn.q_proj
  q.lora_b[...] = jnp.ones_like(q.lora_b[...])
  assert qtunix.add_lora(model, 2, rngs=nnx.Rngs(1)) == 0
  np.testing.assert_array_equal(q.lora_b[...], 1.0)


def test_strict_checks_before_swapping_anything():
  # It swapped the attention projections, then said "Nothing was changed".
  model = _qwen3()
  with pytest.raises(ValueError, match="no_such_layer.*Nothing was changed"):
    qtunix.quantize(model, "fp8_current", rules=[
        qlayers.Rule(pattern="no_such_layer", recipe=None)], strict=True)
  assert type(model.layers[0].attn.q_proj) is qwen3.Einsum
  assert type(model.layers[0].mlp.up_proj) is nnx.Linear
  with pytest.raises(ValueError, match="'attn/q_proj' -> mxfp8"):
    qtunix.quantize(model, "fp8_current", rules=[  # shadowed: decides none
        qlayers.Rule(pattern="attn/q_proj", recipe=None),
        qlayers.Rule(pattern="attn/q_proj", recipe="mxfp8")], strict=True)
  assert type(model.layers[0].attn.q_proj) is qwen3.Einsum
  qtunix.quantize(model, "fp8_current", rules=[  # a Tunix layer matches
      qlayers.Rule(pattern="attn/q_proj", recipe=None)], strict=True)


def test_an_ellipsis_takes_any_number_of_leading_dims():
  q = qtunix.QuantTunixEinsum("...TM,MD->...TD", (32, 16), recipe="bf16",
                              rngs=nnx.Rngs(0))
  for shape in [(3, 32), (2, 3, 32), (2, 2, 3, 32)]:
    x = jax.random.normal(jax.random.key(0), shape)
    want = jnp.einsum("...TM,MD->...TD", x, q.w[...])
    np.testing.assert_allclose(q(x), want, rtol=2e-2, atol=2e-2)


def test_requantizing_a_drop_in_says_to_rebuild_not_to_dequantize():
  # "dequantize_model first" went in a circle: it cannot undo a drop-in.
  net = nnx.Dict(a=qtunix.QuantTunixEinsum(
      "btd,dnh->btnh", (32, 2, 16), recipe="fp8_current", rngs=nnx.Rngs(0)))
  report = qlayers.quantize(net, "mxfp8", rules=())
  assert "rebuild the model" in report.already_quantized[0].reason


def test_keep_wide_rules_of_inspect_match_a_moe_layer(tunix_numpy):
  """A Tunix MoE layer holds three GEMMs; inspect names them
  ``layers/0/mlp:gate_quant`` and its rules keep the layer (``layers/0/mlp``)
  wide (they named ``layers/0/mlp/gate_quant``, which no module path is)."""
  del tunix_numpy

  def moe():
    cfg = qwen3.ModelConfig(
        num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64,
        num_heads=2, head_dim=16, num_kv_heads=1, rope_theta=10_000,
        norm_eps=1e-6, num_experts=2, num_experts_per_tok=1)
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))

  def loss(m, tokens):
    i = _model_inputs({"input_tokens": tokens})
    logits, _ = m(tokens, i["positions"], None, i["attention_mask"])
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  model = moe()
  qtunix.quantize(model, "mxfp8")
  report = qlayers.inspect.collect(model, loss, _tokens()[0]["input_tokens"])
  assert "layers/0/mlp:gate_quant[0]" in qlayers.inspect.gradient_noise(report)
  rules = qlayers.inspect.noise_fallback(report, 1e-9)  # every layer wide
  converted = qtunix.quantize(moe(), "mxfp8", rules).converted
  assert not converted, [c.path for c in converted]


def test_merged_adapters_of_a_stack_of_layers_fold_per_layer():
  # Under nnx.vmap, w [L, D, N, H] and the adapters gain the stack dim: the
  # merge's einsum had too few indices (and layers before it stayed merged).
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(rngs):
    q = qtunix.QuantTunixEinsum("BTD,DNH->BTNH", (32, 2, 16),
                                recipe="fp8_current", rngs=rngs)
    qtunix.add_lora(q, 4, rngs=rngs)
    return q

  q = make(nnx.Rngs(0))
  q.lora_b.set_value(jax.random.normal(jax.random.key(3), q.lora_b.shape))
  w, a, b = (np.asarray(v[...], np.float64) for v in (q.w, q.lora_a,
                                                       q.lora_b))
  assert qtunix.merge_lora(q) == 1
  np.testing.assert_allclose(q.w[...], w + np.einsum("ldr,lrnh->ldnh", a, b),
                             rtol=1e-6, atol=1e-6)
