"""QuantGemm: the one quantized-GEMM core every qlayers layer runs.

A `QuantGemm` is a small NNX module holding what a quantized GEMM needs
besides its operands: the recipe, the backend, the delayed-scaling state (as
`QuantState` / `QuantGradState` Variables) and the train/eval mode. Every
layer of qlayers owns one per GEMM (at ``.quant``) and differs from the
others only in what it owns (a kernel, a tied embedding, several
projections) and in how it maps its shapes onto ``x (..., K) @ w (K, N)``.

It is also a `lax.dot_general`-compatible callable, so a stock layer takes
it as its ``dot_general``::

  nnx.Linear(512, 512, dot_general=qlayers.QuantGemm("fp8_delayed"), rngs=...)

(a stock layer casts its kernel to ``dtype`` before the call, so the kernel
is quantized from that cast; the qlayers layers quantize the FP32 master).

Train/eval follows NNX: ``model.eval()`` sets ``use_running_average=True``
(as for ``nnx.BatchNorm``), and then the layer scales from its stored amax
history and records nothing (its state keeps its values); ``model.train()``
resumes updating it.

Under a mesh the state is replicated (placed so when built under
``jax.set_mesh``; `nnx.get_partition_spec` gives ``P()`` for it), and every
amax it records is the whole tensor's (see `qlayers.sharding`).
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
import zlib
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx

from qlayers import formats
from qlayers import history_roll
from qlayers import ops
from qlayers import sharding
from qlayers.delayed import merge_amax
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import QTensor, ScaleState
from qlayers.state import QuantGradState, QuantState
from qlayers.table import check_backend

__all__ = ["QuantGemm", "QuantLayer", "gemms", "update_scales"]

class QuantGemm(nnx.Module):
  """One quantized GEMM: recipe, backend, delayed-scaling state and mode.

  For a delayed-scaling recipe it holds, per operand role ``x`` (input),
  ``w`` (weight) and ``g`` (output gradient), ``{role}_amax_history``
  (completed steps, index 0 most recent) and ``{role}_amax`` (the running
  max of the current step): `QuantState` Variables, except ``g_amax``, a
  `QuantGradState` (it is only known in the backward pass; see
  `qlayers.value_and_grad` and `qlayers.update_scales`). A recipe with
  ``sr_key = "step"`` adds ``sr_seed`` and ``sr_step`` (uint32 `QuantState`:
  the stochastic-rounding key of each call, see `rounding_key`). Other
  recipes hold no Variables.

  Args:
    recipe: a recipe name, TOML path or `Recipe` (default
      ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``); default: chosen
      per platform and format (see ``qlayers.backends()``).
    batch_shape: leading shape of the state, one per stacked layer (for
      layers made under ``nnx.vmap``).
    use_running_average: start in eval mode (see the module docstring).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> lin = nnx.Linear(64, 32, rngs=nnx.Rngs(0),
    ...                  dot_general=qlayers.QuantGemm("fp8_delayed"))
    >>> lin(jnp.ones((2, 64))).shape
    (2, 32)
    >>> sorted(nnx.state(lin, qlayers.QuantVariable)["dot_general"])[:2]
    ['g_amax', 'g_amax_history']
  """

  def __init__(self, recipe: Recipe | str = "fp8_delayed", *,
               backend: str | None = None,
               batch_shape: tuple[int, ...] = (),
               use_running_average: bool = False):
    self.recipe = load_recipe(recipe)
    self.backend = check_backend(backend)
    self._eval = bool(use_running_average)
    if isinstance(batch_shape, (int, np.integer)):  # as jnp.zeros takes it
      batch_shape = (int(batch_shape),)
    state = ops.init_state(self.recipe, tuple(batch_shape))
    # Replicated over the mesh being built under (if any), whatever the
    # layout of the Params.
    state = jax.tree.map(sharding.replicated, state)
    for role, st in (state or {}).items():
      setattr(self, f"{role}_amax_history", QuantState(st.amax_history))
      kind = QuantGradState if role == "g" else QuantState
      setattr(self, f"{role}_amax", kind(st.amax))
    if self.recipe.sr_key == "step":
      # Stochastic rounding keyed by (seed, call counter): Recipe.sr_key.
      # Stacked layers get seeds 0, 1, ...; the layers seed them from their
      # initial weights (`seed_from`), `qlayers.quantize` from their paths
      # (`qlayers.recipe_rules.seed_rounding`).
      seeds = jnp.arange(math.prod(batch_shape),
                         dtype=jnp.uint32).reshape(tuple(batch_shape))
      self.sr_seed = QuantState(sharding.replicated(seeds))
      self.sr_step = QuantState(sharding.replicated(jnp.zeros_like(seeds)))
    # Assigned once here, as model.eval() assigns it: NNX records the name
    # in the module's static fields at the first assignment, so the graph
    # (and a jitted step's cache key) is the same before and after.
    self.use_running_average = self._eval

  def seed_from(self, weight: jax.Array) -> None:
    """Seeds step-keyed stochastic rounding (``sr_key = "step"``) from the
    layer's initial ``weight``: its FP32 bit patterns summed as integers,
    plus the stack index. Layers built by hand then draw bits as distinct
    as their initial weights (with one seed, layers of equal shapes would
    draw the same bits at every step), and the same weights give the same
    seed on every run. `qlayers.recipe_rules.seed_rounding` replaces them
    with seeds from the layers' paths. Does nothing for other recipes.

    Example:
      >>> import jax
      >>> a, b = QuantGemm("nvfp4"), QuantGemm("nvfp4")
      >>> a.seed_from(jax.random.normal(jax.random.key(0), (4, 4)))
      >>> b.seed_from(jax.random.normal(jax.random.key(1), (4, 4)))
      >>> int(a.sr_seed[...]) != int(b.sr_seed[...])
      True
    """
    if self.recipe.sr_key != "step":
      return
    bits = jax.lax.bitcast_convert_type(
        jnp.asarray(weight).astype(jnp.float32), jnp.uint32)
    stack = self.sr_seed[...]
    index = jnp.arange(stack.size, dtype=jnp.uint32).reshape(stack.shape)
    self.sr_seed.set_value(sharding.replicated(
        jnp.sum(bits, dtype=jnp.uint32) + index))

  @property
  def delayed(self) -> bool:
    """Whether this GEMM keeps delayed-scaling state."""
    return self.recipe.delayed

  @property
  def use_running_average(self) -> bool:
    """Eval mode (see the module docstring). ``model.eval()`` sets it; the
    switch checks that this GEMM's training steps were ended (a warning
    if it recorded amaxes but its histories never moved: see
    `qlayers.update_scales`)."""
    return self._eval

  @use_running_average.setter
  def use_running_average(self, value: bool) -> None:
    if value and not self._eval:
      _warn_if_steps_never_ended(self)
    self._eval = bool(value)

  def set_view(self, use_running_average: bool | None = None):
    """Used by ``nnx.view``: sets the mode (see the module docstring)."""
    if use_running_average is not None:
      self.use_running_average = use_running_average

  # --------------------------------------------------------------------------
  # State

  def read(self) -> dict[str, ScaleState] | None:
    """The state as `ops.quantized_matmul` takes it (None if stateless)."""
    if not self.delayed:
      return None
    return {role: ScaleState(getattr(self, f"{role}_amax_history")[...],
                             getattr(self, f"{role}_amax")[...])
            for role in ops.ROLES}

  def write(self, new_state: dict[str, ScaleState] | None) -> None:
    """Stores what the op returned (nothing for a stateless recipe): the
    forward roles' running amax (not in eval mode), and the gradient role's
    amax, which the op passes through unchanged (in eval mode, not where a
    jax transform NNX does not see forbids it). Storing that one chains the
    next use of this GEMM in the step to this one, so the backward pass hands
    each use the later uses' gradient amax to combine by max (see
    `qlayers.gemm`), where a value read twice would have its cotangents
    summed."""
    if not self.delayed:
      return
    # set_value, not [...] =: assignment inside a trace re-traces in NNX.
    if self.use_running_average:
      # Only the chain, of the same value: an eval decode loop under
      # lax.fori_loop (a transform NNX does not see) forbids the write.
      with contextlib.suppress(flax_errors.TraceContextError):
        self.g_amax.set_value(new_state["g"].amax)
      return
    self.g_amax.set_value(new_state["g"].amax)
    for role in ("x", "w"):
      getattr(self, f"{role}_amax").set_value(
          jax.lax.stop_gradient(new_state[role].amax))

  def rounding_key(self) -> jax.Array | None:
    """This call's stochastic-rounding key (``sr_key = "step"``; None
    otherwise): `formats.rounding_key` of ``sr_seed`` and ``sr_step``, which
    a training call advances by one."""
    if self.recipe.sr_key != "step":
      return None
    step = self.sr_step[...]
    if not self.use_running_average:
      self.sr_step.set_value(step + jnp.uint32(1))
    return formats.rounding_key(self.sr_seed[...], step)

  # --------------------------------------------------------------------------
  # The GEMM

  def matmul(self, x: jax.Array, w: jax.Array, *, bias: jax.Array | None = None,
             out_dtype=None, out_sharding=None,
             w_quantized: QTensor | None = None) -> jax.Array:
    """``x (..., K) @ w (K, N) [+ bias (N,)]``, quantized by the recipe.

    ``w`` is quantized from the value given (pass the FP32 master), or read
    from ``w_quantized``, its stored codes (`ops.quantized_matmul`); the
    output has ``out_dtype`` (see `ops.quantized_matmul` for the default)
    and, when given, the sharding ``out_sharding``.
    """
    with self.writing_state("matmul"):
      y, new_state = ops.quantized_matmul(
          x, w, self.recipe, self.read(), out_dtype=out_dtype,
          key=self.rounding_key(), backend=self.backend, site=self,
          w_quantized=w_quantized)
      self.write(new_state)
    return _finish(y, bias, out_sharding)

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers,
               precision=None, preferred_element_type=None,
               out_sharding=None, rhs_quantized: QTensor | None = None
               ) -> jax.Array:
    """`lax.dot_general` of an input ``lhs`` and a weight ``rhs``, quantized.

    ``precision`` is ignored: the recipe sets the operand precision.
    ``rhs_quantized``: ``rhs``'s stored codes (`ops.quantized_dot_general`).
    """
    del precision
    with self.writing_state("__call__"):
      y, new_state = ops.quantized_dot_general(
          lhs, rhs, dimension_numbers, self.recipe, self.read(),
          preferred_element_type=preferred_element_type,
          backend=self.backend, key=self.rounding_key(), site=self,
          rhs_quantized=rhs_quantized)
      self.write(new_state)
    return _finish(y, None, out_sharding)

  @contextlib.contextmanager
  def writing_state(self, method: str) -> Iterator[None]:
    """Turns NNX's error for a state write from inside a jax transform
    NNX does not see (``jax.jit``, or the jit ``jnp.einsum(...,
    _dot_general=gemm)`` runs it under) into one saying what to do."""
    try:
      yield
    except flax_errors.TraceContextError as e:
      raise RuntimeError(
          f"{type(self).__name__}.{method} (recipe {self.recipe.name!r}) "
          "writes its state (delayed-scaling amaxes, the rounding counter) "
          "to its Variables, which it cannot do inside a jax transform NNX "
          "does not see: use nnx.jit / nnx.vmap / nnx.grad rather than "
          "jax's, and call this GEMM directly rather than through "
          "jnp.einsum(..., _dot_general=...) (which runs it under its own "
          "jit; QuantEinsum and QuantExpertsEinsum call it directly), or use "
          "a recipe without state (fp8_current, mxfp8), which per-example "
          "gradients (nnx.vmap over a broadcast model) need too.") from e


def _warn_if_steps_never_ended(gemm: QuantGemm) -> None:
  """Warns when a delayed GEMM recorded input amaxes in training but its
  amax history never moved: `qlayers.update_scales` was never called (the
  stock loop's easy mistake), so its delayed scales, and the gradient's,
  never left their first values. Only on concrete state (eagerly, as
  ``model.eval()`` runs); under a trace, or on a model of shapes
  (``nnx.eval_shape``), nothing is known."""
  if not gemm.delayed:
    return
  amax, history = gemm.x_amax.get_value(), gemm.x_amax_history.get_value()
  if not all(isinstance(v, (jax.Array, np.ndarray))
             and not isinstance(v, jax.core.Tracer) for v in (amax, history)):
    return
  if bool((amax > 0).any()) and not bool((history != 0).any()):
    warnings.warn(
        f"A QuantGemm with the delayed-scaling recipe {gemm.recipe.name!r} "
        "was trained, but its amax histories are still all 0: no training "
        "step was ended. Call qlayers.update_scales(model, grads) after "
        "each optimizer update (qlayers.Optimizer does it), with grads "
        "from qlayers.value_and_grad or nnx.value_and_grad(..., argnums="
        "nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))).",
        stacklevel=4)


def _finish(y, bias, out_sharding):
  if bias is not None:
    y = y + bias.reshape((1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
  if out_sharding is not None:
    y = jax.sharding.reshard(y, out_sharding)
  return y


def injected_op(layer) -> str | None:
  """The op injected into a stock linear layer (``dot_general`` of
  ``nnx.Linear`` / ``nnx.LinearGeneral``, ``einsum_op`` of ``nnx.Einsum``),
  which a quantized drop-in would never call; None where it keeps jax's."""
  if isinstance(layer, nnx.Linear):
    return None if layer.dot_general is jax.lax.dot_general else "dot_general"
  if isinstance(layer, nnx.LinearGeneral):
    return (None if layer.dot_general is None
            and layer.dot_general_cls is None else "dot_general")
  if isinstance(layer, nnx.Einsum):
    return None if layer.einsum_op is jnp.einsum else "einsum_op"
  return None


def hand_made(model: nnx.Module) -> list[str]:
  """Paths of the stock layers of ``model`` that run a `QuantGemm` given
  them by hand (``nnx.Linear(..., dot_general=QuantGemm(...))``): not
  qlayers layers, so `qlayers.freeze`, `qlayers.add_lora` and
  `qlayers.dequantize_model` leave them, and say so."""
  return ["/".join(map(str, path)) or type(node).__name__
          for path, node in nnx.iter_graph(model)
          if isinstance(getattr(node, injected_op(node) or "", None),
                        QuantGemm)]


class QuantLayer:
  """Mixin of the qlayers layers: each runs its GEMM through the `QuantGemm`
  at ``self.quant`` (`isinstance(m, QuantLayer)` finds them all)."""

  def _refuse_injected_op(self) -> None:
    """A drop-in runs its own quantized GEMM: an op given to the stock
    constructor would silently never be called, so it is refused."""
    op = injected_op(self)
    if op is not None:
      raise ValueError(
          f"{type(self).__name__} runs its own quantized GEMM and would never "
          f"call the {op} it was given; drop the {op} argument, or keep the "
          "stock layer for that op.")

  quant: QuantGemm

  def gemm_kernel(self) -> tuple[jax.Array, jax.Array]:
    """``(value, as_read)``: the kernel the GEMM quantizes, and the kernel
    as ``kernel[...]`` reads it (what dtype promotion sees). One array for a
    Param; for a frozen kernel (`qlayers.freeze`, a checkpoint's), the value
    is its FP32 dequantization: rounded to a narrower Param dtype first, a
    kernel with FP32 block scales would requantize off its stored codes."""
    kernel = self.kernel
    if isinstance(kernel, nnx.Variable):
      value = kernel[...]
      return value, value
    value = jax.lax.stop_gradient(kernel.dequantize(jnp.float32))
    return value, value.astype(kernel.dtype)

  def stored_kernel(self) -> QTensor | None:
    """A frozen kernel's codes (`qlayers.FrozenKernel.qtensor`) where it
    was quantized by the recipe's Fprop weight spec (`qlayers.freeze`'s
    default), for the GEMM to read as they are rather than requantize its
    dequantized values (the same bits, without the wide pass); else
    None."""
    kernel = self.kernel
    if isinstance(kernel, nnx.Variable) or kernel.spec != self.recipe.fprop.rhs:
      return None  # a Param, or codes of another spec (none for "bf16")
    return kernel.qtensor()

  @property
  def recipe(self) -> Recipe:
    return self.quant.recipe

  @property
  def backend(self) -> str | None:
    return self.quant.backend


def gemms(model: nnx.Module) -> Iterator[tuple[tuple, QuantGemm]]:
  """Every `QuantGemm` in ``model`` with its path (each shared one once)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, QuantGemm):
      yield path, node


def check_gemm_sharing(model: nnx.Module) -> None:
  """Warns where the `QuantGemm` state of ``model`` is shared by accident:
  one stateful QuantGemm (delayed scaling, step-keyed stochastic rounding)
  serving stock layers that hold different kernels (``dot_general=`` built
  once and passed to several), which then scale every weight by one amax
  history and round with one seed; and such step-keyed GEMMs of kernels
  of one shape whose seeds are equal (a QuantGemm made by hand starts at
  0; the qlayers layers seed theirs), which draw the same bits.
  `qlayers.Optimizer` calls it (the warnings' ``stacklevel`` points at its
  caller)."""
  kernels: dict[int, tuple[QuantGemm, list[str], set[int]]] = {}
  shapes: dict[int, tuple[int, ...]] = {}  # a hand-made GEMM's kernel shape
  for path, node in nnx.iter_graph(model):
    gemm = getattr(node, "dot_general", None)
    if not isinstance(gemm, QuantGemm) or not isinstance(
        getattr(node, "kernel", None), nnx.Variable):
      continue
    _, where, ids = kernels.setdefault(id(gemm), (gemm, [], set()))
    where.append("/".join(map(str, path)) or type(node).__name__)
    ids.add(id(node.kernel))
    shapes[id(gemm)] = tuple(node.kernel.shape)
  shared = [where for gemm, where, ids in kernels.values()
            if len(ids) > 1 and (gemm.delayed or gemm.recipe.sr_key == "step")]
  if shared:
    warnings.warn(
        f"One QuantGemm is the dot_general of layers with different "
        f"kernels ({'; '.join(', '.join(w) for w in shared)}): they share "
        "its delayed-scaling state and rounding seed, so each weight is "
        "scaled by the others' amaxes. Give each layer a QuantGemm of its "
        "own.", stacklevel=6)
  seeds = [(shapes[id(gemm)], gemm.sr_seed.get_value())
           for gemm, _, _ in kernels.values() if gemm.recipe.sr_key == "step"]
  if any(isinstance(s, jax.core.Tracer) or not isinstance(s, jax.Array)
         for _, s in seeds):
    return
  flat = [(shape, int(v)) for shape, s in seeds for v in np.ravel(s)]
  if len(set(flat)) < len(flat):
    warnings.warn(
        "Several GEMMs with step-keyed stochastic rounding have the same "
        "rounding seed (a QuantGemm made by hand starts at 0), so those of "
        "equal shapes draw the same bits at every step: call "
        "qlayers.recipe_rules.seed_rounding(model) once after building it.",
        stacklevel=6)


def seed_rounding(model: nnx.Module, seed: int = 0, *,
                  only: Iterable[QuantGemm] | None = None) -> int:
  """Gives every ``sr_key = "step"`` GEMM of ``model`` its own rounding seed:
  CRC-32 of its module path plus ``seed`` (stacked layers add their index),
  so layers of equal shapes do not draw the same bits. ``only``: seed just
  these GEMMs (`qlayers.quantize` seeds the ones it converts, with
  ``seed=0``, and leaves the others' seeds alone); call it again for another
  seed. Returns the number of GEMMs seeded.

  Example:
    >>> import qlayers
    >>> from flax import nnx
    >>> from qlayers.recipe_rules import seed_rounding
    >>> model = nnx.Sequential(qlayers.QuantDense(16, 16, rngs=nnx.Rngs(0),
    ...                                           recipe="nvfp4"),
    ...                        qlayers.QuantDense(16, 16, rngs=nnx.Rngs(1),
    ...                                           recipe="nvfp4"))
    >>> seed_rounding(model)
    2
    >>> int(model.layers[0].quant.sr_seed[...]) != int(
    ...     model.layers[1].quant.sr_seed[...])
    True
  """
  try:
    seed = operator.index(seed)
  except TypeError:
    raise TypeError(f"seed_rounding: seed must be an integer, got "
                    f"{seed!r}.") from None
  n = 0
  chosen = None if only is None else {id(g) for g in only}
  for path, gemm in gemms(model):
    if gemm.recipe.sr_key != "step" or (
        chosen is not None and id(gemm) not in chosen):
      continue
    base = zlib.crc32("/".join(map(str, path)).encode()) + seed
    stack = gemm.sr_seed[...]
    index = jnp.arange(stack.size, dtype=jnp.uint32).reshape(stack.shape)
    gemm.sr_seed.set_value(jnp.uint32(base % 2**32) + index)
    n += 1
  return n


def update_scales(model: nnx.Module, grads: nnx.State | None = None, *,
                  applied: bool | jax.Array = True) -> int:
  """Ends a training step for every quantized GEMM of ``model``.

  Writes the gradient amaxes from ``grads`` (where it holds `QuantGradState`
  values: `qlayers.value_and_grad` returns them, as does
  ``nnx.value_and_grad(..., argnums=nnx.DiffState(0, (nnx.Param,
  qlayers.QuantGradState)))``), then rolls every amax history one step:
  one kernel per GEMM where the program may run on an NVIDIA GPU
  (`qlayers.history_roll`), XLA's ops elsewhere, with the same values.
  `qlayers.Optimizer.update` calls it; with another optimizer, call it once
  per step after the update, or delayed scales never move (``model.eval()``
  then warns: a trained GEMM whose histories are all 0).

  ``applied``: whether the optimizer applied this step (a traced bool
  too). A step it skipped (non-finite gradients) enters every history as
  0, "no information", as a non-finite amax does: its batch's finite
  amaxes (a huge ``x`` beside a NaN target) would otherwise set the
  scales of the next ``amax_history_len`` steps. `qlayers.Optimizer`
  passes it.

  Returns:
    The number of `QuantGemm` modules updated (those holding amax
    histories: a stateless recipe's have none).

  Raises:
    TypeError: ``model`` is not an ``nnx.Module`` or ``grads`` neither None
      nor an ``nnx.State`` (the two swapped).
    ValueError: ``grads`` holds a gradient amax at a path where ``model``
      has none (the grads of another model); nothing is written then.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import qlayers
    >>> model = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> diff = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
    >>> loss = lambda m, x: jnp.mean(m(x) ** 2)
    >>> _, grads = nnx.value_and_grad(loss, argnums=diff)(model,
    ...                                                   jnp.ones((2, 8)))
    >>> _ = opt.update(model, grads)
    >>> qlayers.update_scales(model, grads)
    1
    >>> float(model.quant.g_amax_history[0]) > 0
    True
  """
  if not isinstance(model, nnx.Module) or not (
      grads is None or isinstance(grads, nnx.State)):
    raise TypeError(f"update_scales(model, grads) takes the model, then its "
                    f"gradients (an nnx.State or None); got "
                    f"{type(model).__name__}, {type(grads).__name__}.")
  updates = _grad_amaxes(model, grads)
  n = 0
  for path, gemm in gemms(model):
    states = gemm.read()
    if not states:
      continue
    n += 1
    # The gradient amax (by max; a non-finite one carries no information),
    # then the roll: one kernel per GEMM on NVIDIA GPUs.
    new = history_roll.end_step(
        list(states.values()),
        [updates.get((*path, f"{role}_amax")) for role in states],
        None if applied is True else applied)
    for role, st in zip(states, new):
      getattr(gemm, f"{role}_amax_history").set_value(st.amax_history)
      getattr(gemm, f"{role}_amax").set_value(st.amax)
  return n


def merge_grad_amaxes(model: nnx.Module, grads: nnx.State) -> None:
  """Writes the gradient amaxes in ``grads`` into ``model``'s running
  amaxes (by max, as `update_scales` writes them) without ending the step:
  for the gradients of a loss whose step another call ends (parameter
  groups: ``qlayers.Optimizer(..., end_step=False)``)."""
  updates = _grad_amaxes(model, grads)
  state = nnx.state(model, QuantGradState)
  flat = dict(nnx.to_flat_state(state))
  for path, value in updates.items():
    flat[path].set_value(merge_amax(flat[path].get_value(), value))
  nnx.update(model, state)


def _grad_amaxes(model: nnx.Module, grads: nnx.State | None
                 ) -> dict[tuple, jax.Array]:
  """The gradient amaxes in ``grads`` (`QuantGradState` values) by path;
  an error where one has no place in ``model``."""
  if grads is None:
    return {}
  updates = {path: v.get_value() for path, v in nnx.to_flat_state(
      nnx.state(grads, QuantGradState))}
  known = {path for path, _ in nnx.to_flat_state(
      nnx.state(model, QuantGradState))}
  if unknown := sorted(map(str, set(updates) - known)):
    raise ValueError(
        "update_scales: grads hold gradient amaxes at paths the model has "
        f"none at: {', '.join(unknown[:3])}. Pass the grads of this model.")
  return updates
