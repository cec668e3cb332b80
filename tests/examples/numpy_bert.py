"""An independent float64 NumPy forward of a Hugging Face BERT checkpoint.

Reads the safetensors names directly (PyTorch ``[out, in]`` weights), so it
shares no code with ``examples/_common/bert.py``; the tests compare the two.
"""

import numpy as np
from scipy.special import erf


def _layer_norm(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def _linear(w, prefix, x):
  return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]


def bert_hidden(w, input_ids, attention_mask, *, n_layers, n_heads, eps=1e-12):
  """Last hidden states ``[B, T, D]`` (float64) for int ``[B, T]`` inputs."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  b, t = input_ids.shape
  x = (w["embeddings.word_embeddings.weight"][input_ids]
       + w["embeddings.position_embeddings.weight"][np.arange(t)][None]
       + w["embeddings.token_type_embeddings.weight"][np.zeros_like(input_ids)])
  x = _layer_norm(
      x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps
  )
  d = x.shape[-1]
  hd = d // n_heads
  bias = np.where(attention_mask[:, None, None, :] > 0, 0.0, -1e9)
  for i in range(n_layers):
    p = f"encoder.layer.{i}."
    split = lambda y: y.reshape(b, t, n_heads, hd).transpose(0, 2, 1, 3)  # noqa: E731
    q = split(_linear(w, p + "attention.self.query", x))
    k = split(_linear(w, p + "attention.self.key", x))
    v = split(_linear(w, p + "attention.self.value", x))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + bias
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    ctx = (s @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = _layer_norm(x + _linear(w, p + "attention.output.dense", ctx),
                    w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"], eps)
    h = _linear(w, p + "intermediate.dense", x)
    h = 0.5 * h * (1.0 + erf(h / np.sqrt(2.0)))
    x = _layer_norm(x + _linear(w, p + "output.dense", h),
                    w[p + "output.LayerNorm.weight"],
                    w[p + "output.LayerNorm.bias"], eps)
  return x


def sentence_embeddings(hidden, attention_mask):
  """Masked mean over tokens, then unit L2 norm (float64 ``[B, D]``)."""
  m = attention_mask[:, :, None].astype(np.float64)
  pooled = (hidden * m).sum(1) / m.sum(1)
  return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
