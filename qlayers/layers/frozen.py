"""Frozen quantized base weights: a layer's kernel held as payload + scales.

For fine-tuning on quantized weights (LoRA beside a frozen base), a
`qlayers.QuantDense` / `qlayers.QuantLinearGeneral` can hold its kernel as a
`FrozenKernel` instead of an FP32 ``nnx.Param``: the quantized payload and
its scales as `FrozenWeight` Variables (never Params, so ``nnx.grad``,
``nnx.Optimizer`` and `qlayers.Optimizer` give them no gradient, master or
moments), about 1 byte per weight in FP8 and 0.53 in MXFP4 against 4 for the
FP32 master (16 with Adam's moments).

``layer.kernel[...]`` still reads the kernel (dequantized, stop-gradient, in
the kernel's shape). Stored in the recipe's own Fprop weight format
(`freeze`'s default), the base GEMM reads the stored codes as they are
(`QuantLayer.stored_kernel`), the bits its quantization of the dequantized
kernel would give; stored in another, it quantizes the dequantized kernel
in the recipe's format.
Biases and norms stay as they are. `freeze` converts a model's layers;
`FrozenKernel.from_qtensor` takes a kernel straight from an FP8 checkpoint
(`qlayers.checkpoint.read_safetensors(..., quantized=True)`).

Stored layout: the 2-D ``(N, K)`` kernel (PyTorch's ``(out, in)``,
quantized along ``K``: FP4 payloads pack along it), as Hugging Face
checkpoints store weights; an FP8 payload without the zero padding to whole
blocks (a 576 x 192 kernel in 128 x 128 blocks would store 640 x 256).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np

from qlayers import scaling
from qlayers.layers.core import QuantGemm, QuantLayer, hand_made
from qlayers.layers.dense import QuantDense
from qlayers.layers.embed import QuantEmbed
from qlayers.layers.experts import QuantRaggedDot
from qlayers.layers.general import (QuantEinsum, QuantLinearGeneral,
                                    einsum_gemm_plan)
from qlayers.scaling import QTensor, QuantSpec

__all__ = ["FrozenWeight", "FrozenKernel", "freeze", "frozen_kernels",
           "kernel_sharding", "CHECKPOINT_SPEC"]

# The weight format of FP8-shipped checkpoints (DeepSeek-V3, Qwen3-FP8).
CHECKPOINT_SPEC = QuantSpec(format="e4m3", granularity="block",
                            block_size=128, scale_rule="deepseek")


def _checkpoint_spec(qt: QTensor) -> QuantSpec:
  """`CHECKPOINT_SPEC` in block-scaled ``qt``'s layout where it has one."""
  if qt.format != "e4m3" or qt.granularity != "block":
    return CHECKPOINT_SPEC
  mantissa, _ = np.frexp(np.asarray(qt.scale, np.float32))
  spec = dataclasses.replace(CHECKPOINT_SPEC,
                             pow2=bool(np.all(mantissa == 0.5)))
  if len(set(qt.block)) != 1:
    return spec
  try:
    return dataclasses.replace(spec, block_size=int(qt.block[0]))
  except ValueError:  # a block QuantSpec cannot take (8, 96): 128 x 128
    return spec


class FrozenWeight(nnx.Variable):
  """Payload or scales of a frozen quantized weight: never a Param, so it
  gets no gradient and no optimizer state; checkpoints carry it."""


class FrozenKernel(nnx.Module):
  """A kernel of shape ``shape`` held as a `QTensor` of its 2-D ``(N, K)``
  transpose (``K``: the first ``n_in`` dims of one layer's kernel).

  A stack of layers made under ``nnx.vmap`` (kernel ``(L, K, N)``) stores
  each layer's codes and scales along the leading ``L``, quantized on its
  own; ``nnx.scan`` / ``nnx.vmap`` over the stack hand each layer its own,
  as they hand it its slice of a Param.

  Attributes:
    payload, scale: `FrozenWeight` Variables (the QTensor's arrays; for
      NVFP4, ``scale`` holds the E4M3 block scales and ``tensor_scale``
      the per-tensor FP32 scale, the two levels its GEMM takes apart).
    spec: the `QuantSpec` it was quantized with (`requantize` uses it).
    shape: the kernel's shape (a stack's leading dims, then one layer's);
      ``dtype``: the dtype ``[...]`` returns.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers.scaling import QuantSpec
    >>> k = FrozenKernel.quantize(jnp.ones((64, 32)),
    ...                           QuantSpec(format="e2m1", granularity="mx"))
    >>> k.payload.shape, k.scale.shape, k.shape, k.bytes_per_weight
    ((32, 32), (32, 2), (64, 32), 0.53125)
    >>> float(k[...].sum())
    2048.0
  """

  def __init__(self, qt: QTensor, spec: QuantSpec, shape, *, n_in: int = 1,
               dtype=jnp.float32, sharding: tuple = ()):
    if qt.ndim != 2 or qt.axis != 1 or qt.transposed:
      raise ValueError(f"FrozenKernel takes a 2-D (N, K) QTensor quantized "
                       f"along axis 1; got shape {qt.shape}, axis {qt.axis}.")
    # A stack's QTensor (`quantize(..., stacked=)`) carries the stack's
    # dims ahead of each array's own.
    shape, stack = tuple(shape), qt.payload.shape[:qt.payload.ndim - 2]
    layer = shape[len(stack):]
    k, n = math.prod(layer[:n_in]), math.prod(layer[n_in:])
    if qt.shape != (n, k) or shape[:len(stack)] != stack:
      raise ValueError(f"A kernel of shape {shape} ({n_in} input dims) needs "
                       f"an (N, K) = {(n, k)} QTensor"
                       + (f" per layer of a {stack} stack" if stack else "")
                       + f", got {qt.shape}.")
    payload = qt.payload
    if qt.block is not None and not qt.fmt.packed:
      payload = payload[..., :n, :k]  # the rest is zero padding: not stored
    # The kernel's sharding names, as (N, K) (for `nnx.get_partition_spec`
    # and a restore into an abstract model; nothing is placed here): a
    # scale per row of K's blocks shares the payload's rows, 2-D blocks'
    # few scales are replicated.
    self.sharding = tuple(sharding)
    meta = dict(self.sharding)
    names = _stored_names(meta.pop("out_sharding", None), n_in, len(shape),
                          len(stack))
    self.payload = FrozenWeight(payload, **_names_metadata(names, meta))
    levels = qt.tensor_scale is not None
    scale = qt.block_scale if levels else qt.scale
    s = len(stack)
    self.scale = FrozenWeight(scale, **_names_metadata(
        names and scale.ndim == s + 2 and scale.shape[s] == n
        and (*names[:s + 1], None), meta))
    # Data even when None: `requantize` may give it a value.
    self.tensor_scale = nnx.data(FrozenWeight(qt.tensor_scale) if levels
                                 else None)
    self._padded = tuple(qt.payload.shape[-2:])  # one layer's
    self.spec = spec
    self.layer_shape = layer
    self.n_in = n_in
    self.dtype = jnp.dtype(dtype)
    self._layout = (qt.format, qt.granularity, qt.block)

  @classmethod
  def quantize(cls, kernel: jax.Array, spec: QuantSpec, *,
               n_in: int = 1, key: jax.Array | None = None,
               sharding: tuple = (), stacked: int = 0) -> FrozenKernel:
    """``kernel`` (``n_in`` leading input dims) quantized as ``spec`` says,
    along its input (contraction) dims; ``key``: the PRNG key of a
    stochastically rounding ``spec`` (required there, unused elsewhere);
    ``sharding``: its Param's sharding metadata (`kernel_sharding`), which
    the stored payload and scales keep, as their ``(N, K)`` layout has it;
    ``stacked``: how many leading dims of ``kernel`` are a stack of layers
    (``nnx.vmap``), each quantized on its own (with its own fold of
    ``key``).

    The GEMM quantizes the kernel it reads, the dequantized one: stored as
    the fixed point of that requantization, the codes are the ones the GEMM
    uses. Elsewhere that round changes no value (an MX or power-of-two
    block may halve its scale and double its codes); an NVFP4 block whose
    E4M3 scale is subnormal (a quiet block beside a large tensor amax)
    changes its values in it, once, where the GEMM would at every call."""
    if spec.stochastic and key is None:
      raise ValueError(
          f"A kernel stored with stochastic rounding ({spec.format} "
          f"{spec.granularity}, rounding='stochastic') draws its rounding "
          "from a PRNG key: pass key=jax.random.key(...), or a spec that "
          "rounds to nearest.")
    stack = tuple(kernel.shape[:stacked])
    k = math.prod(kernel.shape[stacked:stacked + n_in])
    if k == 0 or kernel.size == 0:
      raise ValueError(f"A kernel of shape {tuple(kernel.shape)} has no "
                       "weights to quantize.")

    def one(w, key):
      w = w.reshape(k, -1).T.astype(jnp.float32)
      qt = scaling.quantize(w, spec, axis=1, key=key)
      if not spec.stochastic:
        for _ in range(2):
          qt = scaling.quantize(qt.dequantize(jnp.float32)[:w.shape[0],
                                                           :w.shape[1]],
                                spec, axis=1)
      return qt

    key = key if spec.stochastic else None
    if not stack:
      qt = one(kernel, key)
    else:
      layers = math.prod(stack)
      flat = kernel.reshape(layers, *kernel.shape[stacked:])
      keys = None if key is None else jax.random.split(key, layers)
      qt = jax.vmap(one)(flat, keys)
      qt = jax.tree.map(lambda a: a.reshape(*stack, *a.shape[1:]), qt)
    return cls(qt, spec, kernel.shape, n_in=n_in, dtype=kernel.dtype,
               sharding=sharding)

  @classmethod
  def from_qtensor(cls, qt: QTensor, shape=None, *, n_in: int = 1,
                   spec: QuantSpec | None = None,
                   dtype=jnp.float32, sharding: tuple = ()) -> FrozenKernel:
    """A kernel from an ``(out, in)`` QTensor as `read_safetensors` gives
    one (``shape``: the kernel's, default ``(in, out)``); its payload is
    kept as it is (an FP8 checkpoint loads without requantizing).

    ``spec`` (what `requantize`, e.g. `qlayers.merge_lora`, stores): by
    default the checkpoint's own layout, `CHECKPOINT_SPEC` with the
    QTensor's square block size and, where every scale is a power of two
    (UE8M0 scales), power-of-two scales; non-square blocks, and square
    ones a `QuantSpec` cannot take (8 x 8, 96 x 96), requantize in
    128 x 128 blocks. ``sharding``: as `quantize` takes it."""
    shape = (qt.shape[1], qt.shape[0]) if shape is None else shape
    return cls(qt, spec or _checkpoint_spec(qt), shape, n_in=n_in,
               dtype=dtype, sharding=sharding)

  @property
  def stack(self) -> tuple[int, ...]:
    """The leading dims of a stack of layers (``nnx.vmap``); ``()`` for one
    layer's kernel, and for a layer's slice inside ``nnx.scan``."""
    payload = self.payload.get_value()
    return tuple(payload.shape[:payload.ndim - 2])

  @property
  def shape(self) -> tuple[int, ...]:
    return self.stack + self.layer_shape

  def qtensor(self) -> QTensor:
    """The stored `QTensor` (``(N, K)``, axis 1) of one layer's kernel
    (of a stack: inside ``nnx.scan`` / ``nnx.vmap``, which slice it)."""
    if self.stack:
      raise ValueError(
          f"FrozenKernel.qtensor: this kernel is a stack of layers "
          f"{self.shape}; a GEMM reads one layer's, inside nnx.scan or "
          "nnx.vmap over the stack (dequantize() reads them all).")
    tensor_scale = (None if self.tensor_scale is None
                    else self.tensor_scale[...])
    return self._layer_qtensor(self.payload[...], self.scale[...],
                               tensor_scale)

  def _layer_qtensor(self, payload, scale, tensor_scale) -> QTensor:
    n_in, shape = self.n_in, self.layer_shape
    k, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    if payload.shape != self._padded:  # zero padding to whole blocks
      payload = jnp.pad(payload, [(0, p - s) for p, s in
                                  zip(self._padded, payload.shape)])
    levels = {}
    if tensor_scale is not None:  # NVFP4: f32(block) * tensor, exactly
      levels = dict(block_scale=scale, tensor_scale=tensor_scale)
      scale = scale.astype(jnp.float32) * tensor_scale
    return QTensor(payload, scale, *self._layout, 1, (n, k), **levels)

  @property
  def layout(self) -> tuple:
    """``(element format, granularity, block)`` the stored payload and
    scales are read in."""
    return self._layout

  def dequantize(self, dtype=None) -> jax.Array:
    """The kernel, in its shape, in ``dtype`` (default: ``self.dtype``)."""
    def one(payload, scale, tensor_scale):
      qt = self._layer_qtensor(payload, scale, tensor_scale)
      return qt.dequantize(jnp.float32).T.reshape(self.layer_shape)

    arrays = [None if v is None else v[...]
              for v in (self.payload, self.scale, self.tensor_scale)]
    stack = self.stack
    if stack:  # each layer on its own, the stack's dims flattened
      flat = [None if a is None else a.reshape(-1, *a.shape[len(stack):])
              for a in arrays]
      w = jax.vmap(one)(*flat).reshape(self.shape)
    else:
      w = one(*arrays)
    return w.astype(dtype or self.dtype)

  def __getitem__(self, index) -> jax.Array:
    """``kernel[...]`` as a Param reads: the dequantized kernel, constant
    (stop-gradient)."""
    return jax.lax.stop_gradient(self.dequantize())[index]

  def requantize(self, kernel: jax.Array, *,
                 key: jax.Array | None = None) -> None:
    """Stores ``kernel`` (same shape) quantized with ``spec``, in place
    (``key``: as `quantize` takes it)."""
    if tuple(kernel.shape) != self.shape:
      raise ValueError(f"requantize: kernel shape {kernel.shape}, expected "
                       f"{self.shape}.")
    new = FrozenKernel.quantize(kernel, self.spec, n_in=self.n_in, key=key,
                                sharding=self.sharding,
                                stacked=len(self.stack))
    self.payload.set_value(new.payload[...])
    if (self.tensor_scale is None) == (new.tensor_scale is None):
      self.scale.set_value(new.scale[...])
      if new.tensor_scale is not None:
        self.tensor_scale.set_value(new.tensor_scale[...])
    else:  # stored in another layout than ``spec``'s (`from_qtensor`)
      self.scale, self.tensor_scale = new.scale, new.tensor_scale
    self._layout, self._padded = new._layout, new._padded

  @property
  def nbytes(self) -> int:
    return sum(v[...].nbytes for v in (self.payload, self.scale,
                                       self.tensor_scale) if v is not None)

  @property
  def bytes_per_weight(self) -> float:
    """Stored bytes (payload + scales) per kernel element."""
    return self.nbytes / math.prod(self.shape)


def kernel_sharding(var) -> tuple:
  """The sharding metadata of a kernel Variable ``var`` a frozen copy keeps
  (``out_sharding``: its per-dim names, as a tuple; ``sharding_rules``:
  logical-to-mesh rules), as sorted ``(key, value)`` pairs."""
  if not isinstance(var, nnx.Variable):
    return ()
  meta = var.get_metadata()
  out = {k: meta[k] for k in ("out_sharding", "sharding_rules")
         if meta.get(k) is not None}
  names = out.get("out_sharding")
  if isinstance(names, jax.sharding.NamedSharding):
    names = names.spec
  if names is not None:
    out["out_sharding"] = tuple(names)
  return tuple(sorted((k, _hashable(v)) for k, v in out.items()))


def _hashable(v):
  """``v`` with its lists as tuples (a module's static attributes hash)."""
  return tuple(map(_hashable, v)) if isinstance(v, (list, tuple)) else v


def _stored_names(names, n_in: int, ndim: int, stacked: int = 0
                  ) -> tuple | None:
  """A kernel's per-dim axis names as its stored ``(N, K)`` payload's
  (behind the names of a stack's ``stacked`` leading dims): of one layer's
  output dims, then its input dims, a flattened dim takes the name of its
  leading dim where that alone is named (the flat dim is then split as
  that dim was); else it is unnamed (replicated)."""
  if names is None or len(names) != ndim:
    return None

  def flat(group):
    return group[0] if group and all(n is None for n in group[1:]) else None
  stack, layer = tuple(names[:stacked]), names[stacked:]
  stored = stack + (flat(layer[n_in:]), flat(layer[:n_in]))
  return None if all(n is None for n in stored) else stored


def _names_metadata(names, meta: dict) -> dict:
  """A `FrozenWeight`'s metadata for sharding ``names`` (none: {}) and the
  kernel's other sharding metadata ``meta``: kept for
  `nnx.get_partition_spec`, not applied when it is made."""
  if not names or all(n is None for n in names):
    return {}
  return {"out_sharding": tuple(names), "eager_sharding": False, **meta}


def contracted_dims(layer, where: str, *, stacks: bool = False
                    ) -> int | None:
  """The number of leading input (contracted) dims of ``layer``'s kernel
  (of each layer's, in a stack made under ``nnx.vmap`` where ``stacks``);
  None for an einsum (``QuantEinsum``, ``nnx.Einsum``) whose contracted
  dims do not lead; ValueError for a kernel of another shape (a stack,
  unless ``stacks``)."""
  shape, single = tuple(layer.kernel.shape), single_kernel_shape(layer)
  stack = layer_stack(layer)
  if shape[len(stack):] != single or (stack and not stacks):
    what = ("the einsum's kernel_shape" if isinstance(layer, nnx.Einsum)
            else "(in, out) =")
    raise ValueError(
        f"{where}: kernel {shape} is not {what} {single} (a stack of "
        "layers made under nnx.vmap, or batch dims?); it takes single "
        "layers.")
  if isinstance(layer, nnx.Einsum):
    _, rhs, _, contracted, _ = einsum_gemm_plan(layer.einsum_str)
    return len(contracted) if rhs[:len(contracted)] == contracted else None
  return len(_features(layer.in_features))


def layer_stack(layer) -> tuple[int, ...]:
  """The leading dims of ``layer``'s kernel ahead of one layer's
  (`single_kernel_shape`): ``()`` for one layer, the stack's dims for
  layers made under ``nnx.vmap``."""
  shape, single = tuple(layer.kernel.shape), single_kernel_shape(layer)
  return shape[:max(len(shape) - len(single), 0)]


def _features(n) -> tuple:
  return n if isinstance(n, tuple) else (n,)


def single_kernel_shape(layer) -> tuple[int, ...]:
  """The kernel shape of one ``layer`` (a linear layer's ``(in..., out...)``,
  an einsum's ``kernel_shape``): a kernel of another shape is a stack of
  layers made under ``nnx.vmap`` (or a batched ``LinearGeneral``)."""
  if isinstance(layer, nnx.Einsum):
    return tuple(layer.kernel_shape)
  return _features(layer.in_features) + _features(layer.out_features)


def frozen_kernels(model: nnx.Module) -> Iterator[tuple[tuple, nnx.Module]]:
  """Every layer of ``model`` whose kernel is a `FrozenKernel`, with its
  path.

  Example:
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> _ = qlayers.freeze(layer)
    >>> [(p, type(m).__name__) for p, m in frozen_kernels(layer)]
    [((), 'QuantDense')]
  """
  for path, node in nnx.iter_graph(model):
    if isinstance(getattr(node, "kernel", None), FrozenKernel) and not (
        isinstance(node, FrozenKernel)):
      yield path, node


def settle_delayed(node, kernel=None) -> None:
  """Fills a delayed GEMM's weight amax history with its kernel's amax
  (per stacked layer; 0 if not finite, as a step records it), after the
  kernel (a `QuantEmbed`'s table) was replaced: the old amaxes in the
  history would scale the new kernel off for as many steps as it holds,
  and in eval mode for good (a merged adapter's larger amax saturates). A
  frozen kernel's amax no step changes again (a GEMM that requantizes a
  kernel stored in another format scales by it). `freeze`,
  `qlayers.merge_lora` and `qlayers.hf.load_tensors` call it; ``kernel``:
  the weight where it is not ``node.kernel``."""
  gemm = getattr(node, "quant", None)
  kernel = getattr(node, "kernel", None) if kernel is None else kernel
  if isinstance(node, QuantEmbed):  # its tied head quantizes the table
    kernel = node.embedding
  if gemm is None or not gemm.delayed or not isinstance(
      kernel, (FrozenKernel, nnx.Variable)):
    return
  value = (kernel.dequantize(jnp.float32) if isinstance(kernel, FrozenKernel)
           else jnp.asarray(kernel[...], jnp.float32))
  stack = gemm.w_amax[...].ndim
  a = jnp.max(jnp.abs(value), axis=tuple(range(stack, value.ndim)))
  a = jnp.where(jnp.isfinite(a), a, 0.0)
  history = gemm.w_amax_history[...]
  gemm.w_amax_history.set_value(
      jnp.broadcast_to(a[..., None], history.shape).astype(history.dtype))
  gemm.w_amax.set_value(a.astype(gemm.w_amax[...].dtype))


def check_key(call: str, stochastic: list[str], key) -> None:
  """Before ``call`` stores any kernel: the ``stochastic`` ones (their
  paths) round stochastically, which needs a PRNG ``key``."""
  if stochastic and key is None:
    raise ValueError(
        f"{call}: {', '.join(stochastic)} would store kernels with "
        f"stochastic rounding, which draws from a PRNG key: pass "
        f"{call}(..., key=jax.random.key(...)), or a spec that rounds to "
        "nearest.")


def check_finite(call: str, kernels: Iterable[tuple[str, jax.Array]]
                 ) -> None:
  """Before ``call`` stores any kernel: each of ``kernels`` (path, value;
  read one at a time) holds no NaN or Inf, which would store NaN scales or codes in place of
  the weights (a traced or not fully addressable value is not read)."""
  bad = [f"{where} ({n} of {np.size(value)} values)"
         for where, value in kernels
         if not isinstance(value, jax.core.Tracer)
         and getattr(value, "is_fully_addressable", True)
         and (n := int(jnp.sum(~jnp.isfinite(value))))]
  if bad:
    raise ValueError(
        f"{call}: NaN or Inf in the kernels it would store for "
        f"{', '.join(bad)}: they would store NaN codes or scales in place "
        "of the weights. Nothing was stored.")


def _frozen(node, spec: QuantSpec, n_in: int, key) -> FrozenKernel:
  """``node``'s kernel quantized as ``spec``, keeping its sharding names; a
  kernel sharded over explicit mesh axes that JAX cannot quantize in place
  is an error naming it."""
  try:
    return FrozenKernel.quantize(
        node.kernel[...], spec, n_in=n_in, key=key,
        sharding=kernel_sharding(node.kernel),
        stacked=len(layer_stack(node)))
  except Exception as e:  # JAX's ShardingTypeError is not public
    if type(e).__name__ != "ShardingTypeError":
      raise
    spec_of = jax.typeof(node.kernel.get_value()).sharding.spec
    first = (str(e).splitlines() or [""])[0][:200]
    raise ValueError(
        f"freeze: a {type(node).__name__} kernel of shape "
        f"{tuple(node.kernel.shape)}, sharded over explicit mesh axes "
        f"({spec_of}), cannot be quantized in place as {spec.format} "
        f"{spec.granularity} (JAX: {first}); freeze the model before "
        "sharding it (outside jax.set_mesh), or shard it over Auto "
        "axes.") from e


# The layers whose kernels `freeze` stores.
FREEZABLE = (QuantDense, QuantLinearGeneral, QuantEinsum)


def freeze(model: nnx.Module, *, spec: QuantSpec | None = None,
           key: jax.Array | None = None) -> int:
  """Replaces the kernel Param of every `qlayers.QuantDense`,
  `qlayers.QuantLinearGeneral` and `qlayers.QuantEinsum` (whose contracted
  kernel dims lead, as in ``"btd,dnh->btnh"``) in ``model`` by a
  `FrozenKernel`, in place; returns how many.

  Args:
    model: a model with qlayers layers (`qlayers.quantize` makes them).
    spec: how to store the kernels; default: each layer's recipe's Fprop
      weight spec, so its base GEMM runs on the stored payload values.
    key: a PRNG key, needed where a kernel is stored with stochastic
      rounding (each layer draws from its own fold of it).

  A stack of layers made under ``nnx.vmap`` (a model scanned over its
  layers) is stored layer by layer, each with its own scales; ``nnx.scan``
  over it hands each layer its own codes. A kernel keeps its Param's
  sharding names (``out_sharding`` metadata), as its stored ``(N, K)``
  payload's, so `nnx.get_partition_spec` and a restore into an abstract
  model place it as the kernel was placed.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``.
    ValueError: the model has no qlayers layer (quantize it first), a
      layer's recipe quantizes no weight (``"bf16"``) and no ``spec`` was
      given, a kernel has no weights, a ``spec`` rounds stochastically
      and no ``key`` was given, ``spec`` differs from a
      kernel already frozen in another (`qlayers.dequantize_model` first),
      a kernel holds NaN or Inf, or a kernel sharded over explicit mesh
      axes cannot be quantized in place (nothing is then frozen). Other qlayers layers (an einsum
      contracting trailing kernel dims, logits heads, experts) keep their
      weights, with a warning naming them; kernels already frozen stay as
      they are.

  Example:
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="mxfp4", rngs=nnx.Rngs(0))
    >>> qlayers.freeze(layer)
    1
    >>> nnx.state(layer, nnx.Param)["kernel"]
    Traceback (most recent call last):
    ...
    KeyError: 'kernel'
    >>> layer.kernel.payload.dtype, layer.kernel.bytes_per_weight
    (dtype('uint8'), 0.53125)
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"freeze takes an nnx.Module, got "
                    f"{type(model).__name__}.")
  if not any(isinstance(node, (QuantLayer, QuantGemm))
             for _, node in nnx.iter_graph(model)):
    raise ValueError("freeze found no qlayers layer to freeze (quantize the "
                     "model first: qlayers.quantize).")
  return freeze_kernels(model, spec=spec, key=key)


def freeze_kernels(model: nnx.Module, *, spec: QuantSpec | None = None,
                   key: jax.Array | None = None) -> int:
  """`freeze` of a model that may hold no qlayers layer (none frozen:
  0), as `qlayers.quantize(..., frozen=True)` calls it."""
  todo, paths, left = [], [], []
  for path, node in nnx.iter_graph(model):
    where = "/".join(map(str, path)) or type(node).__name__
    kernel = getattr(node, "kernel", None)
    if (spec is not None and isinstance(node, FREEZABLE)
        and isinstance(kernel, FrozenKernel) and kernel.spec != spec):
      raise ValueError(
          f"freeze: {where}'s kernel is frozen already as {kernel.spec}, "
          f"not the {spec} asked for; qlayers.dequantize_model first to "
          "store it anew.")
    n_in = (contracted_dims(node, where, stacks=True)
            if isinstance(node, FREEZABLE) and isinstance(kernel, nnx.Param)
            else 0)
    if n_in is None or (isinstance(node, QuantLayer) and not isinstance(
        node, (*FREEZABLE, QuantEmbed))):
      left.append(f"{where} ({type(node).__name__})")
    elif isinstance(getattr(node, "ragged_dot", None), QuantRaggedDot):
      left.append(f"{where} (experts: a grouped GEMM)")
    if not n_in:
      continue
    s = spec or node.recipe.fprop.rhs
    if s is None:
      raise ValueError(f"{where}: recipe {node.recipe.name!r} quantizes no "
                       "weight; pass freeze(..., spec=QuantSpec(...)).")
    todo.append((node, s, n_in))
    paths.append(where)
  left += [f"{p} (a stock layer running a QuantGemm)"
           for p in hand_made(model)]
  check_key("freeze", [w for w, s in zip(paths, todo) if s[1].stochastic],
            key)
  check_finite("freeze", [(w, node.kernel[...])
                          for w, (node, _, _) in zip(paths, todo)])
  made = [_frozen(node, s, n_in, None if key is None
                  else jax.random.fold_in(key, i))
          for i, (node, s, n_in) in enumerate(todo)]
  for (node, _, _), kernel in zip(todo, made):  # all made: nothing half-done
    node.kernel = kernel
    settle_delayed(node)
  if left:
    warnings.warn(f"freeze: {', '.join(left)} keep their wide weights "
                  "(only QuantDense, QuantLinearGeneral and QuantEinsum "
                  "kernels with leading contracted dims freeze).",
                  stacklevel=2)
  return len(todo)
