"""Checkpoints of (quantized) models and their optimizers, on orbax.

Orbax writes each checkpoint (items ``model``: Variables other than
quantization state; ``quant``: `QuantVariable` state; ``optimizer``) into a
temporary directory and renames it when complete. `Manager` is orbax's
``CheckpointManager``: numbered steps, keep-last-N, async saves, unfinished
saves removed. qlayers adds what orbax lacks (`qlayers._checkpoint_checks`):
the recipes in the metadata, mismatch errors naming layer and setting,
params-only loads between plain and quantized models, digests of every
file. PRNG keys are saved as key data (orbax cannot describe key dtypes),
Python scalars in JAX's dtype (orbax's int64 or float64 fit no model).
Every process calls save and restore; arrays come back with the target's
shardings. Zero-size arrays hold no data: the target keeps its own.

Hugging Face safetensors checkpoints, FP8-shipped ones included, are read
and written by `read_safetensors` / `write_safetensors` (`qlayers.safetensors`);
LoRA adapters alone by `save_adapters` / `load_adapters` (`qlayers.lora`).
"""

from __future__ import annotations

import glob
import operator
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers import _checkpoint_checks as checks
from qlayers._checkpoint_checks import (CheckpointCorruptError,
                                        CheckpointMismatchError)
from qlayers._version import __version__
from qlayers.layers.core import QuantGemm, gemms
from qlayers.lora import load_adapters, save_adapters
from qlayers.safetensors import (SafetensorsError, read_config,
                                 read_safetensors, write_safetensors)
from qlayers.state import QuantVariable

__all__ = ["Manager", "save", "restore", "read_metadata",
           "CheckpointMismatchError", "CheckpointCorruptError",
           "read_safetensors", "write_safetensors", "read_config",
           "SafetensorsError", "save_adapters", "load_adapters"]

_ITEMS = ("model", "quant", "optimizer")


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _items(model, optimizer) -> dict[str, nnx.State]:
  quant, rest = nnx.state(model, QuantVariable, ...)
  items = {"model": rest, "quant": quant}
  if optimizer is not None:
    items["optimizer"] = nnx.state(optimizer)
  return items


def _key_impl(x):
  """The PRNG implementation of key array ``x``, or of an abstract target's
  key (`jax.random.key_impl` takes only arrays)."""
  return jax.random.key_impl(x if isinstance(x, jax.Array)
                             else jnp.empty((), x.dtype))


def _key_data(x):
  """Key data of key array ``x``; of an abstract key (``nnx.eval_shape``),
  its struct, sharded as the keys are (`jax.random.key_data` takes only
  arrays)."""
  if isinstance(x, jax.Array):
    return jax.random.key_data(x)
  data = jax.eval_shape(jax.random.key_data, x)
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):  # data's axes unsplit
    sharding = jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(
            *sharding.spec, *[None] * (data.ndim - len(sharding.spec))),
        memory_kind=sharding.memory_kind)
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _canonical(x):
  """``x``, a Python scalar or NumPy value in JAX's dtype: orbax would save
  ``1.0`` as float64, which no model (x64 off) restores."""
  if isinstance(x, (bool, int, float, complex, np.ndarray, np.generic)):
    return np.asarray(x, jax.dtypes.canonicalize_dtype(np.result_type(x)))
  return x


def _tree(state: nnx.State) -> dict:
  """Nested ``{str: array}`` of the non-empty arrays (keys as key data,
  Python scalars in JAX's dtype)."""
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    x = var.get_value()
    try:
      x = _key_data(x) if _is_key(x) else _canonical(x)
    except OverflowError:
      raise ValueError(
          f"{'/'.join(map(str, path))} holds {x!r}, which does not fit "
          f"JAX's {jax.dtypes.canonicalize_dtype(np.result_type(x))} (64-bit "
          "values are off): hold it as an array of an explicit dtype."
      ) from None
    if np.size(x):
      node = out
      for p in path[:-1]:
        node = node.setdefault(str(p), {})
      node[str(path[-1])] = x
  return out


def _replace(var, x):
  """``var`` holding ``x`` (key data wrapped as ``var``'s keys were)."""
  old = var.get_value()
  if _is_key(old) and not _is_key(x):  # format 2 restores keys as keys
    x = jax.random.wrap_key_data(x, impl=_key_impl(old))
  return var.replace(x)


def _check_optimizer(optimizer) -> None:
  if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"optimizer must be an nnx.Optimizer, got "
                    f"{type(optimizer).__name__}.")


def _save_args(model, optimizer):
  """Orbax's save arguments and the qlayers description."""
  import orbax.checkpoint as ocp

  checks.check_model(model)
  _check_optimizer(optimizer)
  trees = {name: tree for name, state in _items(model, optimizer).items()
           if (tree := _tree(state))}
  description = {"format": checks.FORMAT, "format_version": checks.VERSION,
                 "qlayers_version": __version__,
                 "jax_version": jax.__version__, "items": list(trees),
                 "has_optimizer": optimizer is not None,
                 "layers": checks.layers(model),
                 "frozen": checks.frozen(model)}
  return ocp.args.Composite(**{name: ocp.args.StandardSave(tree)
                               for name, tree in trees.items()}), description


def _checkpointer(path_class=None):
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      **{name: ocp.StandardCheckpointHandler() for name in _ITEMS}),
                          temporary_path_class=path_class)


def save(path: str | os.PathLike, model: nnx.Module, *,
         optimizer: nnx.Optimizer | None = None,
         overwrite: bool = False) -> pathlib.Path:
  """Saves ``model`` (every Variable) and ``optimizer`` to the directory
  ``path``; returns it. Under ``jax.distributed`` every process calls it.

  Orbax writes the checkpoint beside ``path`` and renames it when complete;
  what a killed save left is removed by the next save to ``path``.
  ``overwrite=True`` replaces a qlayers checkpoint, which orbax deletes
  first: where a kill must never lose the last checkpoint, use `Manager`.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0))
    >>> d = qlayers.checkpoint.save(tempfile.mkdtemp() + "/ckpt", layer)
    >>> qlayers.checkpoint.read_metadata(d)["layers"][""]["recipe"]
    'fp8_delayed'
  """
  from orbax.checkpoint.path import atomicity

  args, description = _save_args(model, optimizer)
  path = pathlib.Path(path).expanduser().absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
  if path.exists() and not (path.is_dir() and ((path / checks.FILE).is_file()
                                               or not any(path.iterdir()))):
    raise FileExistsError(f"{path} exists and is not a qlayers checkpoint; "
                          "refusing to overwrite it.")
  if jax.process_index() == 0:
    pattern = glob.escape(path.name) + atomicity.TMP_DIR_SUFFIX + "*"
    for leftover in path.parent.glob(pattern):
      shutil.rmtree(leftover)
  with _checkpointer(checks.path_class()) as ckptr:
    ckptr.save(path, args, custom_metadata=description, force=overwrite)
  return path


class Manager:
  """Numbered checkpoints ``directory/<step>`` on orbax's
  ``CheckpointManager``, each written as `save` writes one.

  A step is renamed into place when complete, so a killed save never
  touches a finished step, and a new Manager removes what killed saves
  left. Under ``jax.distributed`` every process makes one and calls it.

  Args:
    directory: where the steps go (created if missing).
    max_to_keep: keep only the latest this many steps (default: all).
    async_save: write in a background thread; `save` returns once the
      arrays are copied to host, `restore` and `close` wait for it.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0))
    >>> directory = tempfile.mkdtemp()
    >>> with qlayers.checkpoint.Manager(directory, max_to_keep=2) as m:
    ...   for step in (10, 20, 30):
    ...     _ = m.save(step, layer)
    ...   info = m.restore(qlayers.QuantDense(8, 4, rngs=nnx.Rngs(1)))
    ...   print(m.all_steps(), m.latest_step(), info["step"], info["restored"])
    [20, 30] 30 30 full
  """

  def __init__(self, directory: str | os.PathLike, *,
               max_to_keep: int | None = None, async_save: bool = False):
    import orbax.checkpoint as ocp

    if max_to_keep is not None:
      max_to_keep = _natural(max_to_keep, "max_to_keep", 1,
                             " or None (keep all)")
    keep = None if max_to_keep is None else (
        ocp.checkpoint_managers.LatestN(max_to_keep))
    self.directory = pathlib.Path(directory).expanduser().absolute()
    self._orbax = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            preservation_policy=keep, enable_async_checkpointing=async_save,
            temporary_path_class=checks.path_class(),
            cleanup_tmp_directories=True))

  def save(self, step: int, model: nnx.Module, *,
           optimizer: nnx.Optimizer | None = None) -> pathlib.Path:
    """Saves ``model`` (and ``optimizer``) as a new ``step``, after every
    step saved so far; returns its directory, complete once
    `wait_until_finished` returns. To go on from an earlier step (a
    rollback), `delete` the later ones first."""
    step = _natural(step, "step", 0)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"step {step} is not after the latest saved step {latest} in "
          f"{self.directory}; to go on from an earlier step, delete the "
          f"later ones first (Manager.delete), or save to a new directory.")
    args, description = _save_args(model, optimizer)
    self._orbax.save(step, args=args, custom_metadata=description, force=True)
    return self.directory / str(step)

  def restore(self, model: nnx.Module, *, step: int | None = None,
              **kwargs) -> dict:
    """`restore` (same keyword arguments) of ``step``, default the latest;
    the result also has ``"step"``."""
    self.wait_until_finished()
    step = self.latest_step() if step is None else _natural(step, "step", 0)
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    return {**restore(self.directory / str(step), model, **kwargs),
            "step": step}

  def latest_step(self) -> int | None:
    return self._orbax.latest_step()

  def delete(self, step: int) -> None:
    """Deletes saved ``step`` (after a rollback, the steps past it)."""
    step = _natural(step, "step", 0)  # "1" is not step 1 to orbax
    self.wait_until_finished()
    if step not in self.all_steps():
      raise FileNotFoundError(f"No step {step} in {self.directory}; saved: "
                              f"{self.all_steps()}.")
    self._orbax.delete(step)

  def all_steps(self) -> list[int]:
    return sorted(self._orbax.all_steps())

  def wait_until_finished(self) -> None:
    self._orbax.wait_until_finished()

  def close(self) -> None:
    self._orbax.close()

  def __enter__(self) -> Manager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _natural(value, name: str, least: int, more: str = "") -> int:
  """``value`` as an int (a Python, NumPy or jax integer scalar, such as an
  optimizer's step count) of at least ``least``; else a clear error."""
  try:
    if isinstance(value, bool):
      raise TypeError
    n = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an integer, got {value!r}.") from None
  if n < least:
    raise ValueError(f"{name} must be >= {least}{more}, got {n}.")
  return n


def read_metadata(path: str | os.PathLike) -> dict:
  """The description of the checkpoint at ``path``, checked against its
  digest: versions, ``items``, ``has_optimizer``, per quantized layer its
  ``type``, ``recipe``, ``scaling``, ``amax_history_len`` and
  ``recipe_config``, and ``files`` (size and SHA-256 of each)."""
  path = pathlib.Path(path).expanduser().absolute()
  digests, meta = checks.read(path)
  return {**meta, "files": digests["files"],
          "format_version": digests["format_version"]}


def _reset_quant_state(model: nnx.Module) -> None:
  """Fresh delayed-scaling state (as a newly built layer has), keeping the
  stacked shape of layers made under nnx.vmap and the arrays' shardings;
  step-keyed stochastic rounding restarts its counter (each GEMM keeps its
  seed)."""
  for _, node in gemms(model):
    if node.recipe.sr_key == "step":
      node.sr_step.set_value(jnp.zeros_like(node.sr_step[...]))
    if node.delayed:
      # The amaxes only: a fresh GEMM's sr_seed is 0, 1, ... (not seeded).
      amax = lambda path, _: str(path[-1]).endswith(("_amax", "_amax_history"))
      fresh = nnx.state(QuantGemm(node.recipe, batch_shape=node.x_amax.shape),
                        amax)
      nnx.update(node, jax.tree.map(
          lambda f, o: jax.device_put(f, o.sharding)
          if isinstance(o, jax.Array) else f, fresh, nnx.state(node, amax)))


def _placeable(x, path):
  """The sharding to read ``x``'s array into: an abstract target's
  (``nnx.eval_shape`` under a mesh) placed on the concrete mesh set with
  ``jax.set_mesh``."""
  sharding = getattr(x, "sharding", None)
  if not (isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.AbstractMesh)):
    return sharding
  mesh = jax.sharding.get_mesh()
  if mesh.empty or mesh.shape_tuple != sharding.mesh.shape_tuple:
    raise ValueError(
        f"Restoring {path}: the target's arrays are abstract, sharded over "
        f"the mesh {dict(sharding.mesh.shape)}, but no such concrete mesh "
        "is set: restore under jax.set_mesh(mesh) with the mesh the target "
        "was made for.")
  return jax.sharding.NamedSharding(mesh, sharding.spec)


def restore(path: str | os.PathLike, model: nnx.Module, *,
            optimizer: nnx.Optimizer | None = None,
            params_only: bool | None = None, verify: bool = True) -> dict:
  """Restores a checkpoint of `save` or `Manager` into ``model`` (and
  ``optimizer``) in place, each array with the sharding of the target's.

  The files are checked against their digests (``verify=False``: sizes
  only), then the target against the checkpoint, before any array is read;
  on an error nothing changes. Variables other than quantization state must
  match in path, shape and dtype. Quantization state: ``params_only=None``
  restores it if both sides have quantized layers (the same layers, recipes
  and settings, else `CheckpointMismatchError`) and resets it to fresh if
  either has none (plain <-> quantized); ``True`` always resets it,
  ``False`` always restores it. Every process calls it. Returns
  `read_metadata`'s dict with ``"restored"``: ``"full"`` or ``"params_only"``.
  """
  import orbax.checkpoint as ocp

  checks.check_model(model)
  _check_optimizer(optimizer)
  if params_only not in (None, True, False):
    raise TypeError("params_only must be None, True or False.")
  meta = read_metadata(path)
  path = pathlib.Path(path).expanduser().absolute()
  layers_c, layers_t = meta["layers"], checks.layers(model)
  if params_only is None:
    params_only = not (layers_c and layers_t)
  states = _items(model, optimizer)
  if params_only:
    del states["quant"]
  checks.verify(path, meta, set(states), deep=verify)
  if optimizer is not None and not meta["has_optimizer"]:
    checks.check(path, ["the checkpoint holds no optimizer state (restore "
                        "without optimizer=)"])
  if not params_only:
    checks.check(path, checks.layer_diff(layers_c, layers_t),
                 checks.HINTS["quant"])
  # Frozen payloads are weights: restored either way, read in their layout.
  checks.check(path, checks.frozen_diff(meta.get("frozen"),
                                        checks.frozen(model)))
  targets = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      np.shape(x), jnp.result_type(x), sharding=_placeable(x, path)),
                                _tree(state)) for name, state in states.items()}
  with _checkpointer() as ckptr:
    saved = checks.orbax_read(path, lambda: ckptr.metadata(path).item_metadata)
    for name, tree in targets.items():
      got = saved.get(name) if name in meta["items"] else None
      checks.check(path, checks.variable_diff(
          "model" if name == "quant" else name,
          checks.flat(got.tree if got else {}), checks.flat(tree)),
                   checks.HINTS.get(name))
    read = {name: ocp.args.StandardRestore(tree)
            for name, tree in targets.items() if tree}
    values = checks.orbax_read(path, lambda: ckptr.restore(
        path, ocp.args.Composite(**read))) if read else {}
  # Everything is read: only now is the target changed.
  for name, state in states.items():
    nnx.replace_by_pure_dict(state, values.get(name, {}), _replace)
    nnx.update(optimizer if name == "optimizer" else model, state)
  if params_only:
    _reset_quant_state(model)
  return {**meta, "restored": "params_only" if params_only else "full"}

