"""Peer FP8 / MX libraries applied to the stock benchmark models.

Each ``*_step(cfg, seed=...)`` returns ``(step, state)`` with
``step(state, batch) -> (state, loss)``, exactly like
``models.baseline_step``, for the same stock model with the peer's
quantization applied to every ``nnx.Linear`` GEMM. ``available_peers()``
lists the variants whose library imports, and says why the others do not.

Peers:

* ``flax-fp8``: ``flax.linen.fp8_ops`` functional ops (per-tensor delayed
  scaling, history 1024, HYBRID E4M3 / E5M2), wired into NNX by giving each
  ``nnx.Linear`` a small stateful ``dot_general`` module. Its scale and amax
  history leave the backward pass as "gradients" and are written back over
  the stored values, as linen's ``OVERWRITE_WITH_GRADIENT`` collection does.
* ``qwix-fp8``: Qwix QAT (``QtProvider``) with per-tensor current scaling,
  E4M3 forward, E5M2 gradients.
* ``qwix-mxfp8``: Qwix QAT with ``mxfp8`` (32-element blocks along K)
  forward and backward.
* ``aqt-fp8``: AQT v2 ``DotGeneral`` with per-tensor current scaling,
  E4M3 forward, E5M2 gradients, no stochastic rounding.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from harness import Variant
from models import Config, StepFn, as_step, build_model, linear_paths
from models import loss_fn, make_batch, make_tx, train_step_for

__all__ = ["available_peers", "peer_versions", "flax_fp8_step",
           "qwix_fp8_step", "qwix_mxfp8_step", "aqt_fp8_step"]


# --------------------------------------------------------------------------
# Flax linen fp8_ops, used from NNX.


class Fp8Meta(nnx.Variable):
  """FP8 scale / amax history of one GEMM operand (not a Param)."""


class FlaxFp8DotGeneral(nnx.Module):
  """A ``lax.dot_general``-compatible callable over ``flax.linen.fp8_ops``.

  Holds what linen's ``Fp8DirectDotGeneralOp`` holds (input, kernel and
  output-gradient scale plus amax history of length ``history``) as
  ``Fp8Meta`` Variables and calls ``fp8_ops.fp8_scaled_dot_general``.
  """

  def __init__(self, *, history: int = 1024):
    ones = lambda: jnp.ones((1,), jnp.float32)
    zeros = lambda: jnp.zeros((history,), jnp.float32)
    self.input_scale = Fp8Meta(ones())
    self.kernel_scale = Fp8Meta(ones())
    self.output_grad_scale = Fp8Meta(ones())
    self.input_amax_history = Fp8Meta(zeros())
    self.kernel_amax_history = Fp8Meta(zeros())
    self.output_grad_amax_history = Fp8Meta(zeros())

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    del precision, preferred_element_type, out_sharding
    comp_dtype = rhs.dtype
    return fp8_ops.fp8_scaled_dot_general(
        lhs.astype(comp_dtype), rhs, dimension_numbers,
        preferred_element_type=comp_dtype,
        lhs_scale=self.input_scale[...],
        rhs_scale=self.kernel_scale[...],
        grad_scale=self.output_grad_scale[...],
        lhs_amax_history=self.input_amax_history[...],
        rhs_amax_history=self.kernel_amax_history[...],
        grad_amax_history=self.output_grad_amax_history[...],
        quantize_compute_type=comp_dtype,
    )


def _linears(model: nnx.Module) -> list[nnx.Linear]:
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]


def flax_fp8_step(cfg: Config, *, seed: int = 0) -> tuple[StepFn, Any]:
  """Flax ``fp8_ops`` per-tensor delayed scaling on every ``nnx.Linear``."""
  model = build_model(cfg, seed=seed)
  for lin in _linears(model):
    # A stateful callable on a static attribute must be marked as data.
    lin.dot_general = nnx.data(FlaxFp8DotGeneral())
  opt = nnx.Optimizer(model, make_tx(cfg), wrt=nnx.Param)
  wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))

  @nnx.jit
  def train_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model, batch)
    param_grads, meta = nnx.split_state(grads, nnx.Param, Fp8Meta)
    opt.update(model, param_grads)
    nnx.update(model, meta)  # overwrite, do not add: new scales/histories
    return loss

  return as_step(train_step), (model, opt)


# --------------------------------------------------------------------------
# Qwix (QAT provider).


def _qwix_step(cfg: Config, rule_kwargs: dict[str, Any], *,
               seed: int = 0) -> tuple[StepFn, Any]:
  import qwix

  model = build_model(cfg, seed=seed)
  paths = linear_paths(model)
  rule = qwix.QtRule(
      module_path="|".join(re.escape(p) for p in paths),
      op_names=("dot_general",), **rule_kwargs)
  provider = qwix.QtProvider([rule])
  sample = make_batch(cfg, seed=seed)["inputs"]
  model = qwix.quantize_model(model, provider, sample)
  unused = provider.get_unused_rules()
  if unused:
    raise RuntimeError(f"qwix rules matched no op: {unused}")
  return train_step_for(model, nnx.Optimizer(model, make_tx(cfg),
                                              wrt=nnx.Param))


def qwix_fp8_step(cfg: Config, *, seed: int = 0) -> tuple[StepFn, Any]:
  """Qwix QAT, per-tensor current scaling, E4M3 fwd / E5M2 bwd."""
  return _qwix_step(cfg, dict(
      weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn,
      bwd_qtype=jnp.float8_e5m2, disable_channelwise_axes=True), seed=seed)


def qwix_mxfp8_step(cfg: Config, *, seed: int = 0) -> tuple[StepFn, Any]:
  """Qwix QAT, MXFP8 (E4M3 elements, 32-blocks along K) fwd and bwd."""
  # QtRule alone leaves the activation-gradient GEMM untiled (mxfp8 then
  # refuses), and a tiled forward residual is not reused in the backward
  # pass, so both backward GEMMs are configured through additional_qt_config.
  return _qwix_step(cfg, dict(
      weight_qtype="mxfp8", act_qtype="mxfp8", tile_size=32,
      bwd_qtype="mxfp8", bwd_weight_grad_tile_size=32,
      additional_qt_config=dict(
          dlhs_tile_size=32, dlhs_residual_qtype="mxfp8",
          drhs_residual_qtype="mxfp8")), seed=seed)


# --------------------------------------------------------------------------
# AQT v2.


def _aqt_fp8_config():
  from aqt.jax.v2 import config as aqt_config

  cfg = aqt_config.config_v4(fwd_bits=8, dlhs_bits=8, drhs_bits=8)
  # Backward dots take the output gradient as lhs in AQT: HYBRID formats.
  aqt_config.set_bits(cfg, fwd_lhs_bit="e4m3", fwd_rhs_bit="e4m3",
                      dlhs_lhs_bit="e5m2", dlhs_rhs_bit="e4m3",
                      drhs_lhs_bit="e5m2", drhs_rhs_bit="e4m3")
  aqt_config.set_stochastic_rounding(cfg, False, False, "jax.uniform")
  for dg in (cfg.fwd, cfg.dlhs, cfg.drhs):
    for quantizer in (dg.dg_quantizer.lhs, dg.dg_quantizer.rhs):
      quantizer.calib_shared_axes = "per_tensor"
  return cfg


class _AqtDot:
  """Adapts AQT's ``DotGeneral`` to what ``nnx.Linear`` passes.

  AQT's ``__call__`` has no ``out_sharding`` parameter, and ``nnx.Linear``
  always passes it, so the bare AQT object cannot be injected.
  """

  def __init__(self, dg):
    self.dg = dg

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    if out_sharding is not None:
      raise NotImplementedError("AQT dot_general has no out_sharding")
    return self.dg(lhs, rhs, dimension_numbers, precision,
                   preferred_element_type)


def aqt_fp8_step(cfg: Config, *, seed: int = 0) -> tuple[StepFn, Any]:
  """AQT v2, per-tensor current scaling, E4M3 fwd / E5M2 gradients."""
  dot = _AqtDot(_aqt_fp8_config())
  model = build_model(cfg, seed=seed)
  for lin in _linears(model):
    lin.dot_general = dot
  return train_step_for(model, nnx.Optimizer(model, make_tx(cfg),
                                              wrt=nnx.Param))


# --------------------------------------------------------------------------
# Discovery.


def _try_import(module: str) -> str | None:
  try:
    __import__(module)
  except Exception as e:  # noqa: BLE001 - reported verbatim to the user
    return f"{type(e).__name__}: {e}"
  return None


_PEERS = [
    ("flax.linen.fp8_ops", [Variant(
        "flax-fp8", "flax", "fp8 per-tensor delayed (hist 1024), E4M3/E5M2",
        flax_fp8_step)]),
    ("qwix", [
        Variant("qwix-fp8", "qwix", "fp8 per-tensor current, E4M3/E5M2",
                    qwix_fp8_step),
        Variant("qwix-mxfp8", "qwix", "mxfp8 (E4M3, 32-blocks) fwd+bwd",
                    qwix_mxfp8_step)]),
    ("aqt.jax.v2.aqt_dot_general", [Variant(
        "aqt-fp8", "aqtp", "fp8 per-tensor current, E4M3/E5M2",
        aqt_fp8_step)]),
]


def available_peers() -> tuple[list[Variant], dict[str, str]]:
  """``(variants whose library imports, {library: import error})``."""
  ok, missing = [], {}
  for module, variants in _PEERS:
    err = _try_import(module)
    if err is None:
      ok.extend(variants)
    else:
      missing[variants[0].library] = err
  return ok, missing


def peer_versions() -> dict[str, str]:
  """Installed versions of jax, jaxlib, flax, optax and each peer package."""
  from importlib import metadata

  out = {}
  for dist in ("jax", "jaxlib", "flax", "optax", "qwix", "aqtp"):
    try:
      out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[dist] = "not installed"
  return out
