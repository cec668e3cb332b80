"""Training step, sampling and evaluation for any causal LM
``model(tokens) -> logits``.

The model is an NNX module taking int32 ``[B, T]`` tokens and returning
float32 ``[B, T, V]`` logits, with ``model.config.max_len``. Sampling and
evaluation run the model in NNX's eval mode (`eval_mode`): quantized layers
scale from their stored amax history and record nothing, as dropout layers
turn off; `train_step` is the step that updates the model.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qlayers


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean cross-entropy of float32 ``[B, T, V]`` logits on ``[B, T]`` ids."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)
  return -jnp.mean(picked)


@contextlib.contextmanager
def eval_mode(model: nnx.Module):
  """``model.eval()`` inside the block; each module's mode as it was after.

  In eval mode a delayed-scaling layer scales from its stored history and
  writes nothing, so evaluation and generation leave the next training step
  exactly as they found it.
  """
  flags = ("deterministic", "use_running_average")
  saved = [(m, {f: getattr(m, f) for f in flags if hasattr(m, f)})
           for _, m in nnx.iter_modules(model)]
  model.eval()
  try:
    yield model
  finally:
    for m, attrs in saved:
      for f, v in attrs.items():
        setattr(m, f, v)


@nnx.jit
def train_step(model, optimizer, inputs, targets):
  """One optimizer step on a next-token batch; returns the batch loss.

  ``qlayers.value_and_grad`` returns the Params' gradients together with
  the gradient-side quantization state, and ``qlayers.Optimizer.update``
  applies both (and rolls every delayed-scaling history once). The loss
  scale is the ``fp16`` recipe's dynamic one (1 for the others).
  """
  def loss_fn(model):
    return next_token_loss(model(inputs), targets)
  loss, grads = qlayers.value_and_grad(
      loss_fn, loss_scale=optimizer.loss_scale)(model)
  optimizer.update(model, grads)
  return loss


def _sample(logits, key, temperature, top_k):
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef", "max_new_tokens", "temperature", "top_k", "window",
        "stop_token",
    ),
)
def _generate(graphdef, state, prompt, key, *, max_new_tokens, temperature,
              top_k, window, stop_token):
  b, p = prompt.shape
  total = p + max_new_tokens
  buffer = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)
  done = jnp.zeros((b,), jnp.bool_)

  def cond(carry):
    t, _, done, _ = carry
    return (t < total) & ~jnp.all(done)

  def body(carry):
    t, buffer, done, key = carry
    start = jnp.maximum(t - window, 0)
    context = jax.lax.dynamic_slice_in_dim(buffer, start, window, axis=1)
    # copy=True: fresh Variables at the loop body's trace level, so state a
    # quantized layer writes in its forward pass stays inside the body.
    logits = nnx.merge(graphdef, state, copy=True)(context)
    last = jax.lax.dynamic_index_in_dim(logits, t - 1 - start, 1, False)
    key, sub = jax.random.split(key)
    token = _sample(last, sub, temperature, top_k)
    if stop_token is not None:
      token = jnp.where(done, stop_token, token)
      done = done | (token == stop_token)
    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token[:, None], t, 1)
    return t + 1, buffer, done, key

  t, buffer, _, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(p), buffer, done, key)
  )
  if stop_token is not None:
    filler = jnp.full_like(buffer, stop_token)
    buffer = jnp.where(jnp.arange(total)[None, :] < t, buffer, filler)
  return buffer


def generate(
    model: nnx.Module,
    prompt,
    *,
    max_new_tokens: int,
    key: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    stop_token: int | None = None,
) -> np.ndarray:
  """Samples a continuation of ``prompt`` with a fixed-size token buffer.

  Each step reruns the model on the last ``min(P + N, max_len)`` tokens of
  a ``[B, P + N]`` buffer (no KV cache): shapes never change, so one
  compilation serves the whole loop. Positions after the current one hold
  zeros, which causal attention never reads. Models with relative (rotary)
  positions may continue past ``max_len``; the window just slides.

  Args:
    model: causal LM, ``model(int32 [B, T]) -> float32 [B, T, V]``.
    prompt: int ``[B, P]`` (or ``[P]``) token ids, ``P >= 1``.
    max_new_tokens: ``N``, tokens to add.
    key: PRNG key; required unless ``temperature == 0``.
    temperature: softmax temperature; ``0`` means greedy (argmax).
    top_k: if set, sample only among the ``top_k`` most likely tokens.
    stop_token: if set, a sequence ends after this token (it is kept) and
      the rest of its row is filled with it; the loop ends early once every
      row has stopped.

  Returns:
    int32 numpy ``[B, P + N]`` (``[P + N]`` for a 1-D prompt): the prompt
    followed by the generated tokens.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  squeeze = prompt.ndim == 1
  prompt = prompt[None] if squeeze else prompt
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [B, P] with P >= 1, got {prompt.shape}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if key is None:
    if temperature != 0:
      raise ValueError("pass key= to sample with temperature > 0")
    key = jax.random.key(0)
  total = prompt.shape[1] + max_new_tokens
  with eval_mode(model):
    graphdef, state = nnx.split(model)
  out = _generate(
      graphdef, state, prompt, key,
      max_new_tokens=max_new_tokens, temperature=float(temperature),
      top_k=top_k, window=min(total, model.config.max_len),
      stop_token=stop_token,
  )
  out = np.asarray(out)
  return out[0] if squeeze else out


@functools.partial(jax.jit, static_argnames="graphdef")
def _loss_sum(graphdef, state, inputs, targets):
  logits = nnx.merge(graphdef, state)(inputs)
  return next_token_loss(logits, targets) * targets.size


def perplexity(
    model: nnx.Module, tokens, *, seq_len: int = 256, batch_size: int = 4
) -> float:
  """Perplexity of ``model`` on a 1-D token sequence.

  The text is cut into consecutive windows of ``seq_len`` predicted tokens
  (each window sees only its own tokens, so its first predictions have little
  context); a tail shorter than ``seq_len`` is dropped. Returns
  ``exp(mean next-token cross-entropy)``.
  """
  tokens = np.asarray(tokens, np.int32)
  n = (len(tokens) - 1) // seq_len
  if n < 1:
    raise ValueError(f"need more than seq_len={seq_len} tokens, got {len(tokens)}")
  windows = np.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
  with eval_mode(model):
    graphdef, state = nnx.split(model)
  total = 0.0
  for i in range(0, n, batch_size):
    chunk = jnp.asarray(windows[i:i + batch_size])
    total += float(_loss_sum(graphdef, state, chunk[:, :-1], chunk[:, 1:]))
  return math.exp(total / (n * seq_len))
