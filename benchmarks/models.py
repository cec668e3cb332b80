"""Benchmark models built only from stock ``flax.nnx`` layers.

Every GEMM with a weight is an ``nnx.Linear``, so any library that quantizes
``nnx.Linear`` (by injecting a ``dot_general`` or by swapping layers) covers
all of them. Attention's score and value products are activation x
activation einsums and stay in BF16 for every variant.

The unquantized baseline computes in BF16 (``dtype=bfloat16``) with FP32
master weights (``param_dtype=float32``) and an ``optax.adamw`` optimizer;
norms, softmax, the loss and the optimizer stay in FP32. ``nnx.Linear`` calls
``lax.dot_general`` on BF16 operands with a BF16 result type; the second
baseline, ``baseline_f32acc_step``, is the same model whose linears run all
three GEMMs (forward, input gradient, weight gradient) on BF16 operands with
FP32 accumulation, in the same operand layouts as qlayers' quantized GEMMs on
CPU, and round the results to BF16: the quantized variants minus the
quantization. On CPUs with a native BF16 dot it is the faster form.

Example::

  cfg = TransformerConfig(d_model=64, n_heads=2, n_layers=1, seq_len=16,
                          batch=2, vocab=32)
  model = build_model(cfg, seed=0)
  batch = make_batch(cfg, seed=0)
  print(loss_fn(model, batch))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = [
    "TransformerConfig",
    "MLPConfig",
    "Config",
    "TransformerLM",
    "MLPStack",
    "build_model",
    "make_batch",
    "loss_fn",
    "make_tx",
    "linear_paths",
    "StepFn",
    "as_step",
    "train_step_for",
    "baseline_step",
    "f32acc_dot_general",
    "baseline_f32acc_step",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """A small pre-norm decoder-only transformer LM.

  Shapes: tokens ``[batch, seq_len]`` int32, logits
  ``[batch, seq_len, vocab]``. Each block: LayerNorm, attention with
  ``q, k, v, o`` projections, LayerNorm, MLP ``up`` (d_model -> d_ff), GELU,
  ``down`` (d_ff -> d_model); then a final LayerNorm and an untied ``head``.
  """

  d_model: int = 512
  n_heads: int = 4
  n_layers: int = 2
  d_ff: int = 2048
  seq_len: int = 256
  batch: int = 8
  vocab: int = 256
  learning_rate: float = 3e-4
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @property
  def kind(self) -> str:
    return "transformer"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
  """A residual stack of MLP blocks ``d_model -> d_hidden -> d_model``.

  Shapes: inputs ``[batch, d_model]``, targets ``[batch, d_model]``; the loss
  is the mean squared error against a fixed random teacher.
  """

  d_model: int = 512
  d_hidden: int = 2048
  n_layers: int = 4
  batch: int = 1024
  learning_rate: float = 1e-3
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @property
  def kind(self) -> str:
    return "mlp"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(TransformerConfig):
  """The transformer's sizes with every MLP an MoE layer: the MoE GPT of
  ``examples/_common/moe.py`` (RMSNorm, rotary attention, ``n_experts``
  experts of width ``d_ff // top_k``, top ``top_k``, tokens sorted by
  expert into two ``lax.ragged_dot``). Its loss here is the cross-entropy
  (the load-balancing term is left out of the timed step)."""

  n_experts: int = 8
  top_k: int = 2

  @property
  def kind(self) -> str:
    return "moe"


Config = Union[TransformerConfig, MLPConfig, MoEConfig]


def _moe_model(cfg: MoEConfig, rngs: nnx.Rngs) -> nnx.Module:
  import pathlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
  if examples not in sys.path:
    sys.path.insert(0, examples)
  from _common import moe  # pylint: disable=g-import-not-at-top
  return moe.MoEGPT(moe.MoEConfig(
      vocab_size=cfg.vocab, max_len=cfg.seq_len, d_model=cfg.d_model,
      n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
      n_experts=cfg.n_experts, top_k=cfg.top_k, dtype=cfg.dtype), rngs=rngs)


def _linear(cfg: Config, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, dtype=cfg.dtype,
                    param_dtype=cfg.param_dtype, rngs=rngs)


def _norm(cfg: Config, n: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(n, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                       rngs=rngs)


class Attention(nnx.Module):
  """Causal multi-head self-attention; ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.q = _linear(cfg, d, d, rngs)
    self.k = _linear(cfg, d, d, rngs)
    self.v = _linear(cfg, d, d, rngs)
    self.o = _linear(cfg, d, d, rngs)
    self.n_heads = cfg.n_heads
    self.dtype = cfg.dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.o(self.core(self.q(x), self.k(x), self.v(x)))

  def core(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Scores, causal mask, softmax and the value product (no weights).

    ``[B, T, D]`` projections in, ``[B, T, D]`` out: the part a fused
    (flash) attention kernel replaces.
    """
    b, t, d = q.shape
    h = self.n_heads
    split = lambda y: y.reshape(b, t, h, d // h)
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d // h))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)


class Block(nnx.Module):
  """Pre-norm transformer block; ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.ln1 = _norm(cfg, cfg.d_model, rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln2 = _norm(cfg, cfg.d_model, rngs)
    self.up = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    self.down = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x)).astype(x.dtype)
    y = self.down(self.activation(self.up(self.ln2(x))))
    return x + y.astype(x.dtype)

  def activation(self, h: jax.Array) -> jax.Array:
    """The MLP's nonlinearity: GELU (tanh form)."""
    return jax.nn.gelu(h)


class TransformerLM(nnx.Module):
  """Decoder-only LM; int32 tokens ``[B, T]`` -> f32 logits ``[B, T, V]``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model,
                           param_dtype=cfg.param_dtype, rngs=rngs)
    self.pos = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model),
                                 cfg.param_dtype))
    self.blocks = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.n_layers)])
    self.ln_f = _norm(cfg, cfg.d_model, rngs)
    self.head = _linear(cfg, cfg.d_model, cfg.vocab, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x)).astype(jnp.float32)


class MLPStack(nnx.Module):
  """Residual MLP blocks; f32 ``[B, D] -> [B, D]``."""

  def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
    self.norms = nnx.List([_norm(cfg, cfg.d_model, rngs)
                           for _ in range(cfg.n_layers)])
    self.ups = nnx.List([_linear(cfg, cfg.d_model, cfg.d_hidden, rngs)
                         for _ in range(cfg.n_layers)])
    self.downs = nnx.List([_linear(cfg, cfg.d_hidden, cfg.d_model, rngs)
                           for _ in range(cfg.n_layers)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for norm, up, down in zip(self.norms, self.ups, self.downs):
      x = x + down(jax.nn.gelu(up(norm(x)))).astype(x.dtype)
    return x.astype(jnp.float32)


def build_model(cfg: Config, *, seed: int = 0) -> nnx.Module:
  """The stock model for ``cfg``; the same ``seed`` gives the same weights."""
  rngs = nnx.Rngs(params=seed)
  if isinstance(cfg, MoEConfig):
    return _moe_model(cfg, rngs)
  if isinstance(cfg, TransformerConfig):
    return TransformerLM(cfg, rngs=rngs)
  if isinstance(cfg, MLPConfig):
    return MLPStack(cfg, rngs=rngs)
  raise TypeError(f"unknown config type {type(cfg).__name__}")


def make_batch(cfg: Config, *, seed: int = 0) -> dict[str, jax.Array]:
  """A fixed synthetic batch, identical for every variant.

  Transformer: next-token prediction on uniformly random tokens; the model
  can only memorise the fixed batch, so the loss falls from ``log(vocab)``
  towards 0 over a few tens of steps (about 1.5 after 10 steps with the
  defaults). MLP: Gaussian inputs and targets from a fixed random tanh
  teacher.
  """
  key = jax.random.key(seed + 1_000)
  if isinstance(cfg, TransformerConfig):
    tokens = jax.random.randint(key, (cfg.batch, cfg.seq_len + 1), 0,
                                cfg.vocab, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  k_x, k_w = jax.random.split(key)
  x = jax.random.normal(k_x, (cfg.batch, cfg.d_model), jnp.float32)
  w = jax.random.normal(k_w, (cfg.d_model, cfg.d_model), jnp.float32)
  return {"inputs": x, "targets": jnp.tanh(x @ w / jnp.sqrt(cfg.d_model))}


def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
  """Scalar f32 loss: token cross-entropy (LM) or mean squared error (MLP)."""
  out = model(batch["inputs"])
  if jnp.issubdtype(batch["targets"].dtype, jnp.integer):
    return optax.softmax_cross_entropy_with_integer_labels(
        out, batch["targets"]).mean()
  return jnp.mean((out - batch["targets"]) ** 2)


def make_tx(cfg: Config) -> optax.GradientTransformation:
  """The optimizer every variant uses."""
  return optax.adamw(cfg.learning_rate, weight_decay=0.01)


def linear_paths(model: nnx.Module) -> list[str]:
  """Slash-joined paths of every ``nnx.Linear`` in ``model``."""
  return ["/".join(map(str, path)) for path, m in nnx.iter_modules(model)
          if isinstance(m, nnx.Linear)]


# A train step: (state, batch) -> (state, loss). The state is opaque to the
# harness; every variant returns its own together with the callable.
StepFn = Callable[[Any, dict[str, jax.Array]], tuple[Any, jax.Array]]


def as_step(train_step: Callable[..., jax.Array]) -> StepFn:
  """``train_step(model, opt, batch) -> loss`` as a step on ``(model, opt)``."""

  def step(state, batch):
    model, opt = state
    return state, train_step(model, opt, batch)

  return step


def train_step_for(model: nnx.Module, opt: Any, *,
                   value_and_grad: Callable = nnx.value_and_grad
                   ) -> tuple[StepFn, Any]:
  """The standard jitted step for ``model`` and its optimizer.

  ``value_and_grad`` (``nnx.value_and_grad``, or a library's drop-in) of
  ``loss_fn``, then ``opt.update``; the state ``(model, opt)`` is updated
  in place.
  """

  @nnx.jit
  def train_step(model, opt, batch):
    loss, grads = value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss

  return as_step(train_step), (model, opt)


def baseline_step(cfg: Config, *, seed: int = 0) -> tuple[StepFn, Any]:
  """Unquantized BF16 train step and its initial state ``(model, opt)``."""
  model = build_model(cfg, seed=seed)
  return train_step_for(model, nnx.Optimizer(model, make_tx(cfg),
                                              wrt=nnx.Param))


@jax.custom_vjp
def _f32acc_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x (..., K) @ w (K, N)``: FP32 accumulation, result in ``x.dtype``."""
  return jax.lax.dot_general(
      x, w, (((x.ndim - 1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32).astype(x.dtype)


def _f32acc_fwd(x, w):
  return _f32acc_matmul(x, w), (x, w)


def _f32acc_bwd(res, g):
  x, w = res
  k, n = w.shape
  x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
  dx = jax.lax.dot_general(g2, w, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)
  # x.T @ g written as a contraction over (1, M), as qlayers.dispatch does
  # for its weight gradient: on CPU, XLA runs a BF16 dot whose lhs contracts
  # its first axis as an FP32 dot on upcast copies; this form gets the BF16
  # kernel. The barrier keeps XLA from folding a transpose of the result
  # into the dot (a form its CPU runtime rejects for BF16).
  dw = jax.lax.optimization_barrier(jax.lax.dot_general(
      x2.reshape(1, *x2.shape), g2.reshape(1, *g2.shape),
      (((0, 1), (0, 1)), ((), ())), preferred_element_type=jnp.float32))
  return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype)


_f32acc_matmul.defvjp(_f32acc_fwd, _f32acc_bwd)


def f32acc_dot_general(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None, out_sharding=None):
  """What ``nnx.Linear`` calls, with FP32 accumulation in all three GEMMs.

  The forward and both backward products take the operands in the compute
  dtype and accumulate in FP32 (a plain ``preferred_element_type=float32``
  would hand the backward FP32 cotangents, i.e. FP32 GEMMs); results are
  rounded to the operand dtype. Only the ``nnx.Linear`` contraction
  (last axis of ``lhs`` with axis 0 of a 2-D ``rhs``) is supported.
  """
  del precision
  (lc, rc), (lb, rb) = dimension_numbers
  if (tuple(lc), tuple(rc)) != ((lhs.ndim - 1,), (0,)) or lb or rb or (
      rhs.ndim != 2 or lhs.dtype != rhs.dtype):
    raise NotImplementedError(f"f32acc_dot_general: {dimension_numbers}")
  out = _f32acc_matmul(lhs, rhs)
  if preferred_element_type is not None:
    out = out.astype(preferred_element_type)
  if out_sharding is not None:
    out = jax.sharding.reshard(out, out_sharding)
  return out


def baseline_f32acc_step(cfg: Config, *,
                         seed: int = 0) -> tuple[StepFn, Any]:
  """The BF16 baseline with FP32-accumulating linears (see module doc)."""
  model = build_model(cfg, seed=seed)
  for _, m in nnx.iter_modules(model):
    if isinstance(m, nnx.Linear):
      m.dot_general = f32acc_dot_general
  return train_step_for(model, nnx.Optimizer(model, make_tx(cfg),
                                              wrt=nnx.Param))
