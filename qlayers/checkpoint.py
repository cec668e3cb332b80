"""Checkpoints of (quantized) models and their optimizers, with orbax.

A checkpoint is one orbax composite checkpoint: items ``model`` (Variables
other than quantization state), ``quant`` (`QuantVariable` state) and
``optimizer``, with orbax's tree, shape, dtype and sharding metadata and, as
its custom metadata, the qlayers description (versions, per quantized layer
its recipe and settings). qlayers adds what orbax does not do:

* ``qlayers.json``: size and SHA-256 of every other file. Orbax reads a
  flipped bit in an array's data file back as a wrong value, silently.
* Kill-safe replacement: the new checkpoint is written complete beside the
  old one and swapped in atomically (Linux ``renameat2(RENAME_EXCHANGE)``;
  elsewhere two renames, after which a cut-off swap is found and finished).
* Checks of the target before anything is read into it (same Variables,
  same recipes), and params-only loads that start quantization state fresh.

Under ``jax.distributed`` every process calls `save` and `restore`: orbax
writes each process's shards, process 0 alone writes the metadata and
swaps, every process checks and reads. Arrays come back with the target's
shardings. Zero-size arrays (e.g. `qlayers.Optimizer`'s master markers) hold
no data and orbax cannot save them: they are skipped and kept from the target.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import glob
import hashlib
import itertools
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers.layers.core import QuantGemm, QuantLayer, gemms
from qlayers.state import QuantVariable

__all__ = ["save", "restore", "read_metadata", "CheckpointMismatchError",
           "CheckpointCorruptError"]

FORMAT = "qlayers-checkpoint"
FORMAT_VERSION = 2
DIGESTS_FILE = "qlayers.json"
_ITEMS = ("model", "quant", "optimizer")
_SHOW = 8  # differences listed per category in an error message
_barriers = itertools.count()


class CheckpointMismatchError(ValueError):
  """The checkpoint does not fit the target model or optimizer."""


class CheckpointCorruptError(ValueError):
  """The checkpoint directory is incomplete, damaged or not a checkpoint."""


# ----------------------------------------------------------------------------
# Model state as orbax trees


def _items(model, optimizer) -> dict[str, nnx.State]:
  quant, rest = nnx.state(model, QuantVariable, ...)
  items = {"model": rest, "quant": quant}
  if optimizer is not None:
    items["optimizer"] = nnx.state(optimizer)
  return items


def _tree(state: nnx.State) -> dict:
  """Nested ``{str: array}`` of the non-empty arrays in ``state``."""
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    if np.size(var.get_value()):
      node = out
      for p in path[:-1]:
        node = node.setdefault(str(p), {})
      node[str(path[-1])] = var.get_value()
  return out


def _flat(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k: v for key, sub in tree.items()
          for k, v in _flat(sub, f"{prefix}/{key}" if prefix else key).items()}


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x),
                              sharding=getattr(x, "sharding", None))


def _fill(state: nnx.State, values: dict) -> nnx.State:
  """``state`` with the arrays of ``values`` (zero-size ones kept)."""
  flat = _flat(values)
  return nnx.from_flat_state([
      (path, var.replace(flat["/".join(map(str, path))])
       if np.size(var.get_value()) else var)
      for path, var in nnx.to_flat_state(state)])


def _layers(model: nnx.Module) -> dict[str, dict]:
  """Per quantized layer (or bare `QuantGemm`): type and recipe."""
  nodes = dict(nnx.iter_graph(model))
  out = {}
  for path, node in gemms(model):
    r = node.recipe
    owner = nodes.get(path[:-1]) if path and path[-1] == "quant" else None
    if isinstance(owner, QuantLayer):
      path, node = path[:-1], owner
    out["/".join(map(str, path))] = {
        "type": type(node).__name__, "recipe": r.name,
        "scaling": ("delayed" if r.delayed
                    else "current" if r.quantized else "none"),
        "amax_history_len": r.amax_history_len if r.delayed else None,
        "recipe_config": json.loads(json.dumps(dataclasses.asdict(r)))}
  return out


def _checkpointer():
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      **{name: ocp.StandardCheckpointHandler() for name in _ITEMS}))


def _primary() -> bool:
  return jax.process_index() == 0


def _sync(what: str) -> None:
  """Barrier across processes (a no-op in a single process)."""
  import orbax.checkpoint as ocp

  ocp.multihost.sync_global_processes(
      f"qlayers_checkpoint_{what}_{next(_barriers)}")


# ----------------------------------------------------------------------------
# Digests


def _digest(file: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(file, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _files(path: pathlib.Path) -> dict[str, dict]:
  return {f.relative_to(path).as_posix(): {"size": f.stat().st_size,
                                           "sha256": _digest(f)}
          for f in sorted(path.rglob("*")) if f.is_file()}


def _verify_files(path: pathlib.Path, files: dict, items, digests: bool):
  """Checks the files of ``items`` and the top-level ones against ``files``."""
  problems = []
  for rel, rec in files.items():
    f = path / rel
    if "/" in rel and rel.split("/", 1)[0] not in items:
      continue
    if not f.is_file():
      problems.append(f"{rel} is missing")
    elif f.stat().st_size != rec["size"]:
      problems.append(f"{rel} has {f.stat().st_size} bytes, {rec['size']} "
                      "when saved")
    elif digests and _digest(f) != rec["sha256"]:
      problems.append(f"{rel} changed since it was saved (SHA-256 differs)")
  if problems:
    raise CheckpointCorruptError(f"Checkpoint {path} is damaged:\n" +
                                 "\n".join(_listed("", problems)[1:]))


def _write_json(file: pathlib.Path, obj) -> None:
  tmp = file.with_name(file.name + ".tmp")
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, file)


# ----------------------------------------------------------------------------
# Putting a finished checkpoint in place


def _sibling(path: pathlib.Path, role: str) -> pathlib.Path:
  """Where a checkpoint is written before its swap (``new``), or where the
  old one waits for removal after two renames (``old``)."""
  return path.with_name(f".{path.name}.qlayers-{role}")


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
  """Swaps two directory entries atomically; False where the platform or
  file system cannot."""
  rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
  if rename is None:
    return False
  at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
  if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b),
            rename_exchange) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
    return False
  raise OSError(err, os.strerror(err), str(a), None, str(b))


def _swap_in(new: pathlib.Path, path: pathlib.Path) -> None:
  """Moves the complete checkpoint ``new`` to ``path``. Killed at any point,
  a complete checkpoint is at ``path`` or (between two renames) beside it,
  where `_resolve` finds it."""
  old = None
  if not os.path.lexists(path):
    os.rename(new, path)
  elif _exchange(new, path):
    old = new
  else:
    old = _sibling(path, "old")
    os.rename(path, old)
    os.rename(new, path)
  _fsync_dir(path.parent)
  if old is not None:
    shutil.rmtree(old)


def _resolve(path: pathlib.Path) -> pathlib.Path:
  """``path``, or if a swap by two renames was cut off between them (no
  ``path``, both siblings complete), the new checkpoint beside it."""
  new, old = _sibling(path, "new"), _sibling(path, "old")
  if not os.path.lexists(path) and all((p / DIGESTS_FILE).is_file()
                                       for p in (new, old)):
    return new
  return path


def _recover(path: pathlib.Path) -> None:
  """Finishes a cut-off swap and removes what unfinished saves left."""
  found = _resolve(path)
  if found != path:
    os.rename(found, path)
  for leftover in path.parent.glob(f".{glob.escape(path.name)}.qlayers-*"):
    shutil.rmtree(leftover)  # also orbax's temporary directory


# ----------------------------------------------------------------------------
# Save


def save(path: str | os.PathLike, model: nnx.Module, *,
         optimizer: nnx.Optimizer | None = None,
         overwrite: bool = False) -> pathlib.Path:
  """Saves ``model`` (and ``optimizer``) to the directory ``path``.

  The checkpoint is written beside ``path`` and swapped in when complete: a
  save that is killed leaves the previous checkpoint (or the new one) and
  can simply be run again. Under ``jax.distributed`` every process calls it.

  Args:
    path: checkpoint directory; must not exist unless ``overwrite``.
    model: the model: every Variable is saved (Params, quantization state,
      batch statistics, RNG state, ...), sharded arrays by the processes
      that hold them.
    optimizer: an ``nnx.Optimizer`` (e.g. `qlayers.Optimizer`) to save too.
    overwrite: replace an existing checkpoint (only a directory holding a
      qlayers checkpoint, or an empty one, is ever replaced).

  Returns:
    The absolute checkpoint path.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0))
    >>> d = qlayers.checkpoint.save(tempfile.mkdtemp() + "/ckpt", layer)
    >>> qlayers.checkpoint.read_metadata(d)["layers"][""]["recipe"]
    'fp8_delayed'
  """
  import orbax.checkpoint as ocp
  import qlayers

  _check_model(model)
  if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"optimizer must be an nnx.Optimizer, got "
                    f"{type(optimizer).__name__}.")
  path = pathlib.Path(path).expanduser().absolute()
  if _primary():
    _recover(path)
  _sync("recovered")
  if path.exists():
    if not overwrite:
      raise FileExistsError(f"{path} exists; pass overwrite=True to replace "
                            "it.")
    if not path.is_dir() or not ((path / DIGESTS_FILE).is_file()
                                 or not any(path.iterdir())):
      raise FileExistsError(f"{path} exists and is not a qlayers checkpoint; "
                            "refusing to overwrite it.")
  path.parent.mkdir(parents=True, exist_ok=True)

  trees = {name: _tree(state)
           for name, state in _items(model, optimizer).items()}
  trees = {name: tree for name, tree in trees.items() if tree}
  description = {"format": FORMAT, "format_version": FORMAT_VERSION,
                 "qlayers_version": qlayers.__version__,
                 "jax_version": jax.__version__, "items": list(trees),
                 "has_optimizer": optimizer is not None,
                 "layers": _layers(model)}
  new = _sibling(path, "new")
  with _checkpointer() as ckptr:  # orbax finalizes `new` atomically
    ckptr.save(new, ocp.args.Composite(
        **{name: ocp.args.StandardSave(tree) for name, tree in trees.items()}),
               custom_metadata=description, force=True)
  if _primary():
    _write_json(new / DIGESTS_FILE, {"format": FORMAT,
                                     "format_version": FORMAT_VERSION,
                                     "files": _files(new)})
    _swap_in(new, path)
  _sync("saved")
  return path


# ----------------------------------------------------------------------------
# Restore


def _item_metadata(path: pathlib.Path, item: str):
  """Orbax's tree metadata (shapes, dtypes, shardings) of one item."""
  import orbax.checkpoint as ocp

  handler = ocp.StandardCheckpointHandler()
  try:
    return handler.metadata(path / item).tree
  except Exception as e:  # orbax and tensorstore raise many types
    raise _unreadable(path, e) from e
  finally:
    handler.close()


def _unreadable(path, e: Exception) -> CheckpointCorruptError:
  msg = str(e).splitlines()[0] if str(e) else type(e).__name__
  return CheckpointCorruptError(f"Could not read checkpoint {path}: "
                                f"{msg[:300]}")


def read_metadata(path: str | os.PathLike) -> dict:
  """The description of the checkpoint at ``path`` (raises if not one):
  versions, ``items``, ``has_optimizer``, per quantized layer its ``type``,
  ``recipe``, ``scaling``, ``amax_history_len`` and ``recipe_config``, and
  the ``files`` with their sizes and SHA-256."""
  path = _resolve(pathlib.Path(path).expanduser().absolute())
  if not path.exists():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  if not path.is_dir():
    raise CheckpointCorruptError(f"{path} is not a checkpoint directory.")
  file = path / DIGESTS_FILE
  if not file.is_file():
    raise CheckpointCorruptError(
        f"{path} has no {DIGESTS_FILE}: the save did not finish, or this is "
        "not a qlayers checkpoint.")
  try:
    digests = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointCorruptError(f"{file} is not readable JSON: {e}") from None
  if not (isinstance(digests, dict) and digests.get("format") == FORMAT
          and isinstance(digests.get("files"), dict)):
    raise CheckpointCorruptError(f"{file} is not qlayers checkpoint metadata.")
  if digests.get("format_version") != FORMAT_VERSION:
    raise CheckpointCorruptError(
        f"{path} has checkpoint format version "
        f"{digests.get('format_version')}; this qlayers reads version "
        f"{FORMAT_VERSION}.")
  import orbax.checkpoint as ocp

  try:
    meta = dict(ocp.metadata.get_step_metadata(path).custom_metadata or {})
  except (OSError, ValueError):
    meta = {}
  for key in ("format", "items", "layers", "has_optimizer"):
    if key not in meta:
      raise CheckpointCorruptError(
          f"{path} lacks the qlayers description ({key!r}) in its orbax "
          "metadata.")
  return {**meta, "files": digests["files"]}


def _listed(title: str, items: list[str]) -> list[str]:
  more = len(items) - _SHOW
  shown = items[:_SHOW] + ([f"... and {more} more"] if more > 0 else [])
  return [f"{title}:"] + [f"  {s}" for s in shown] if items else []


def _variable_diff(what: str, ckpt: dict, target: dict) -> list[str]:
  """Differences of two ``{path: ArrayMetadata | ShapeDtypeStruct}``."""
  fmt = lambda x: f"{tuple(x.shape)} {np.dtype(x.dtype)}"
  changed = [f"{p}: checkpoint {fmt(ckpt[p])}, {what} {fmt(target[p])}"
             for p in sorted(set(ckpt) & set(target))
             if fmt(ckpt[p]) != fmt(target[p])]
  return (_listed(f"{what} Variables missing from the checkpoint",
                  sorted(set(target) - set(ckpt)))
          + _listed(f"checkpoint Variables the {what} does not have",
                    sorted(set(ckpt) - set(target)))
          + _listed(f"{what} Variables that differ", changed))


def _layer_diff(ckpt: dict, target: dict) -> list[str]:
  def describe(layer):
    hist = layer["amax_history_len"]
    return (f"{layer['type']} recipe {layer['recipe']!r} ({layer['scaling']}"
            + (f" scaling, amax_history_len={hist})" if hist else " scaling)"))

  changed = []
  for p in sorted(set(ckpt) & set(target)):
    c, t = ckpt[p], target[p]
    fc, ft = _flat(c["recipe_config"]), _flat(t["recipe_config"])
    fields = [f"{k.replace('/', '.')}: {fc.get(k)!r} vs {ft.get(k)!r}"
              for k in sorted(set(fc) | set(ft)) if fc.get(k) != ft.get(k)]
    if c["type"] != t["type"]:
      fields.append(f"layer type {c['type']} vs {t['type']}")
    if fields:
      changed.append(f"{p or '(model)'}: checkpoint {describe(c)}, model "
                     f"{describe(t)}; " + "; ".join(fields))
  only = lambda a, b: [f"{p or '(model)'}: {describe(a[p])}"
                       for p in sorted(set(a) - set(b))]
  return (_listed("layers quantized in the model but not in the checkpoint",
                  only(target, ckpt))
          + _listed("layers quantized in the checkpoint but not in the model",
                    only(ckpt, target))
          + _listed("layers whose recipe differs", changed))


def _mismatch(path, lines: list[str], hint: str = "") -> Exception:
  return CheckpointMismatchError(
      f"Checkpoint {path} does not match the target:\n" + "\n".join(lines)
      + (f"\n{hint}" if hint else ""))


_FRESH_HINT = ("To load only the Params and start the quantization state "
               "fresh, pass params_only=True.")
_OPT_HINT = ("The optimizer must be built like the saved one (same optax "
             "transformation and wrapper, same model Params).")


def _reset_quant_state(model: nnx.Module) -> None:
  """Fresh delayed-scaling state (as a newly built layer has), keeping the
  stacked shape of layers made under nnx.vmap and the arrays' shardings."""
  for _, node in gemms(model):
    if node.delayed:
      fresh = nnx.state(QuantGemm(node.recipe, batch_shape=node.x_amax.shape))
      nnx.update(node, jax.tree.map(
          lambda f, o: jax.device_put(f, o.sharding)
          if isinstance(o, jax.Array) else f, fresh, nnx.state(node)))


def restore(path: str | os.PathLike, model: nnx.Module, *,
            optimizer: nnx.Optimizer | None = None,
            params_only: bool | None = None, verify: bool = True) -> dict:
  """Restores a checkpoint written by `save` into ``model`` (and
  ``optimizer``), in place, each array with the sharding of the target's.

  The target is checked against orbax's metadata and the files against
  their digests before any array is read; on any error nothing is changed.
  The Variables other than quantization state (Params, batch statistics,
  ...) must always match in path, shape and dtype. Under
  ``jax.distributed`` every process must call it.

  Quantization state:

  * ``params_only=None`` (default): if both the checkpoint and the model
    have quantized layers, the same layers must be quantized with the same
    recipes (all settings, e.g. ``amax_history_len``) and their state is
    restored exactly. If either side has no quantized layer (a plain model's
    checkpoint into a quantized model, or the reverse), only the other
    Variables are restored and the model's delayed-scaling state is reset
    to fresh.
  * ``params_only=True``: as the second case, whatever the checkpoint holds
    (e.g. to fine-tune a model under a different recipe).
  * ``params_only=False``: the quantization state must match and is
    restored, as in the first case.

  Args:
    path: a checkpoint directory.
    model: the target model, built as the saved one was (any values).
    optimizer: an optimizer to restore too; the checkpoint must hold one
      with the same state structure.
    params_only: see above.
    verify: check the SHA-256 of every file read (each process reads them
      all); ``False`` checks only that they exist with their saved sizes.

  Returns:
    The checkpoint's metadata (`read_metadata`), with ``"restored"`` set to
    ``"full"`` or ``"params_only"``.

  Raises:
    FileNotFoundError: nothing at ``path``.
    CheckpointCorruptError: ``path`` is not a complete qlayers checkpoint,
      or it was damaged.
    CheckpointMismatchError: the checkpoint does not fit the target.
  """
  import orbax.checkpoint as ocp

  _check_model(model)
  if params_only not in (None, True, False):
    raise TypeError("params_only must be None, True or False.")
  meta = read_metadata(path)
  path = _resolve(pathlib.Path(path).expanduser().absolute())
  if optimizer is not None and not meta["has_optimizer"]:
    raise _mismatch(path, ["the checkpoint holds no optimizer state "
                           "(restore without optimizer=)"])
  layers_c, layers_t = meta["layers"], _layers(model)
  if params_only is None:
    params_only = not (layers_c and layers_t)
  if not params_only:
    lines = _layer_diff(layers_c, layers_t)
    if lines:
      raise _mismatch(path, lines, _FRESH_HINT)

  states = _items(model, optimizer)
  if params_only:
    del states["quant"]
  _verify_files(path, meta["files"], states, digests=verify)
  targets = {name: jax.tree.map(_abstract, _tree(state))
             for name, state in states.items()}
  hints = {"quant": _FRESH_HINT, "optimizer": _OPT_HINT}
  for name, tree in targets.items():
    saved = (_item_metadata(path, name) if name in meta["items"] else {})
    lines = _variable_diff(name if name != "quant" else "model",
                           _flat(saved), _flat(tree))
    if lines:
      raise _mismatch(path, lines, hints.get(name, ""))

  read = {name: tree for name, tree in targets.items() if tree}
  values = {}
  if read:
    try:
      with _checkpointer() as ckptr:
        values = ckptr.restore(path, ocp.args.Composite(
            **{name: ocp.args.StandardRestore(tree)
               for name, tree in read.items()}))
    except Exception as e:  # orbax and tensorstore raise many types
      raise _unreadable(path, e) from e
  # Everything is read: only now is the target changed.
  filled = {name: _fill(state, values[name] if name in read else {})
            for name, state in states.items()}
  for name, state in filled.items():
    nnx.update(optimizer if name == "optimizer" else model, state)
  if params_only:
    _reset_quant_state(model)
  return {**meta, "restored": "params_only" if params_only else "full"}


def _check_model(model) -> None:
  if not isinstance(model, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(model).__name__}.")
