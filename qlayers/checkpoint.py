"""Checkpoints of (quantized) models and their optimizers, with orbax.

A checkpoint is a directory::

  model/        the model's Variables other than quantization state (orbax)
  quant/        its quantization state (`QuantVariable`), when it has any
  optimizer/    the optimizer's state, when one was saved
  qlayers.json  metadata, written last: its presence marks a finished save

The metadata records the qlayers version, every saved Variable (path, type,
shape, dtype), per quantized layer its recipe (name, full settings,
``amax_history_len``) and state shapes, and the size and SHA-256 of every
file orbax wrote. `restore` checks the target model against it and the files
against their digests before reading any array, so a mismatch raises
`CheckpointMismatchError` and a damaged checkpoint `CheckpointCorruptError`
instead of restoring something half-right.

Quantization state is plain FP32 arrays, saved like any other Variable.
Zero-size arrays (e.g. the master-weight markers of `qlayers.Optimizer`)
hold no data; they are recorded in the metadata and rebuilt from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qlayers.recipe import Recipe
from qlayers.layers.core import QuantGemm, QuantLayer, gemms
from qlayers.state import QuantVariable

__all__ = ["save", "restore", "read_metadata", "CheckpointMismatchError",
           "CheckpointCorruptError"]

FORMAT = "qlayers-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "qlayers.json"
_ITEMS = ("model", "quant", "optimizer")
_SHOW = 8  # differences listed per category in an error message


class CheckpointMismatchError(ValueError):
  """The checkpoint does not fit the target model or optimizer."""


class CheckpointCorruptError(ValueError):
  """The checkpoint directory is incomplete, damaged or not a checkpoint."""


# ----------------------------------------------------------------------------
# Describing a model's state


def _str_path(path) -> str:
  return "/".join(str(p) for p in path)


def _value(v):
  return v.get_value() if isinstance(v, nnx.Variable) else v


def _entries(state: nnx.State) -> dict[str, dict]:
  """``{path: {type, shape, dtype}}`` of every Variable in ``state``."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    x = _value(var)
    out[_str_path(path)] = {"type": type(var).__name__,
                            "shape": list(np.shape(x)),
                            "dtype": str(jnp.result_type(x))}
  return out


def _recipe_config(r: Recipe) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(r)))


def _layers(model: nnx.Module, quant: dict[str, dict]) -> dict[str, dict]:
  """Per quantized layer (or bare `QuantGemm`): type, recipe and the shapes
  of its state."""
  nodes = dict(nnx.iter_graph(model))
  out = {}
  for path, node in gemms(model):
    r = node.recipe
    owner = nodes.get(path[:-1]) if path and path[-1] == "quant" else None
    if isinstance(owner, QuantLayer):
      path, node = path[:-1], owner
    p = _str_path(path)
    prefix = p + "/" if p else ""
    out[p] = {
        "type": type(node).__name__,
        "recipe": r.name,
        "scaling": ("delayed" if r.delayed
                    else "current" if r.quantized else "none"),
        "amax_history_len": r.amax_history_len if r.delayed else None,
        "recipe_config": _recipe_config(r),
        "state": {k[len(prefix):]: e["shape"] for k, e in quant.items()
                  if k.startswith(prefix)},
    }
  return out


def _split(model: nnx.Module) -> tuple[nnx.State, nnx.State]:
  quant, rest = nnx.state(model, QuantVariable, ...)
  return rest, quant


# ----------------------------------------------------------------------------
# Arrays in and out of orbax


def _tree(state: nnx.State) -> dict:
  """Nested ``{str: array}`` of the non-empty arrays in ``state``."""
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    x = _value(var)
    if np.size(x) == 0:
      continue
    node = out
    for p in path[:-1]:
      node = node.setdefault(str(p), {})
    node[str(path[-1])] = x
  return out


def _abstract(x):
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x),
                              sharding=sharding)


def _restore_item(directory: pathlib.Path, state: nnx.State) -> nnx.State:
  """``state`` with its values read from the orbax item at ``directory``."""
  import orbax.checkpoint as ocp

  target = jax.tree.map(_abstract, _tree(state))
  if target:
    if not directory.is_dir():
      raise CheckpointCorruptError(f"Checkpoint item {directory} is missing.")
    try:
      with ocp.StandardCheckpointer() as ckptr:
        values = ckptr.restore(directory, target)
    except Exception as e:  # orbax/tensorstore raise many types
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise CheckpointCorruptError(
          f"Could not read checkpoint item {directory}: {msg[:300]}") from e
  else:
    values = {}

  def lookup(path, var):
    x = _value(var)
    if np.size(x) == 0:
      return var.replace(jnp.zeros(np.shape(x), jnp.result_type(x)))
    node = values
    for p in path:
      node = node[str(p)]
    return var.replace(node)

  return nnx.from_flat_state(
      [(path, lookup(path, var)) for path, var in nnx.to_flat_state(state)])


# ----------------------------------------------------------------------------
# File digests


def _digest(file: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(file, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _files(path: pathlib.Path, items) -> dict[str, dict]:
  """``{relative path: {size, sha256}}`` of every file of ``items``."""
  out = {}
  for item in items:
    for f in sorted((path / item).rglob("*")):
      if f.is_file():
        out[f.relative_to(path).as_posix()] = {"size": f.stat().st_size,
                                               "sha256": _digest(f)}
  return out


def _verify_files(path: pathlib.Path, meta: dict, items, digests: bool):
  problems = []
  for rel, rec in meta["files"].items():
    if rel.split("/", 1)[0] not in items:
      continue
    f = path / rel
    if not f.is_file():
      problems.append(f"{rel} is missing")
    elif f.stat().st_size != rec["size"]:
      problems.append(f"{rel} has {f.stat().st_size} bytes, {rec['size']} "
                      "when saved")
    elif digests and _digest(f) != rec["sha256"]:
      problems.append(f"{rel} changed since it was saved (SHA-256 differs)")
  if problems:
    raise CheckpointCorruptError(
        f"Checkpoint {path} is damaged:\n" + "\n".join(
            _listed("files", problems)[1:]))


# ----------------------------------------------------------------------------
# Save


def _describe(model, optimizer) -> dict:
  rest, quant = _split(model)
  quant_entries = _entries(quant)
  variables = {"model": _entries(rest), "quant": quant_entries}
  if optimizer is not None:
    variables["optimizer"] = _entries(nnx.state(optimizer))
  return {"variables": variables, "layers": _layers(model, quant_entries)}


def save(path: str | os.PathLike, model: nnx.Module, *,
         optimizer: nnx.Optimizer | None = None,
         overwrite: bool = False) -> pathlib.Path:
  """Saves ``model`` (and ``optimizer``) to the new directory ``path``.

  Args:
    path: checkpoint directory; must not exist unless ``overwrite``.
    model: the model: every Variable is saved (Params, quantization state,
      batch statistics, RNG state, ...).
    optimizer: an ``nnx.Optimizer`` (e.g. `qlayers.Optimizer`) to save too.
    overwrite: replace an existing checkpoint (only a directory holding a
      qlayers checkpoint, or an empty one, is ever removed).

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
  if path.exists():
    if not overwrite:
      raise FileExistsError(f"{path} exists; pass overwrite=True to replace "
                            "it.")
    if not path.is_dir() or not ((path / METADATA_FILE).is_file()
                                 or not any(path.iterdir())):
      raise FileExistsError(f"{path} exists and is not a qlayers checkpoint; "
                            "refusing to overwrite it.")
    shutil.rmtree(path)
  path.mkdir(parents=True)

  rest, quant = _split(model)
  items = {"model": rest, "quant": quant}
  if optimizer is not None:
    items["optimizer"] = nnx.state(optimizer)
  saved = []
  with ocp.StandardCheckpointer() as ckptr:
    for name, state in items.items():
      tree = _tree(state)
      if tree:
        ckptr.save(path / name, tree)
        saved.append(name)
    ckptr.wait_until_finished()

  meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
          "qlayers_version": qlayers.__version__,
          "jax_version": jax.__version__,
          "items": saved, "has_optimizer": optimizer is not None,
          "files": _files(path, saved), **_describe(model, optimizer)}
  tmp = path / (METADATA_FILE + ".tmp")
  tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
  os.replace(tmp, path / METADATA_FILE)
  return path


# ----------------------------------------------------------------------------
# Restore


def read_metadata(path: str | os.PathLike) -> dict:
  """The metadata of the checkpoint at ``path`` (raises if not one)."""
  path = pathlib.Path(path).expanduser().absolute()
  if not path.exists():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  if not path.is_dir():
    raise CheckpointCorruptError(f"{path} is not a checkpoint directory.")
  file = path / METADATA_FILE
  if not file.is_file():
    raise CheckpointCorruptError(
        f"{path} has no {METADATA_FILE}: the save did not finish, or this is "
        "not a qlayers checkpoint.")
  try:
    meta = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointCorruptError(f"{file} is not readable JSON: {e}") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointCorruptError(f"{file} is not qlayers checkpoint metadata.")
  if meta.get("format_version") != FORMAT_VERSION:
    raise CheckpointCorruptError(
        f"{path} has checkpoint format version {meta.get('format_version')}; "
        f"this qlayers reads version {FORMAT_VERSION}.")
  for key in ("variables", "layers", "items", "files"):
    if key not in meta:
      raise CheckpointCorruptError(f"{file} lacks {key!r}.")
  return meta


def _fmt(e: dict) -> str:
  return f"{e['type']} {tuple(e['shape'])} {e['dtype']}"


def _listed(title: str, items: list[str]) -> list[str]:
  if not items:
    return []
  more = len(items) - _SHOW
  shown = items[:_SHOW] + ([f"... and {more} more"] if more > 0 else [])
  return [f"{title}:"] + [f"  {s}" for s in shown]


def _variable_diff(what: str, ckpt: dict, target: dict) -> list[str]:
  missing = sorted(set(target) - set(ckpt))
  extra = sorted(set(ckpt) - set(target))
  changed = [f"{p}: checkpoint {_fmt(ckpt[p])}, {what} {_fmt(target[p])}"
             for p in sorted(set(ckpt) & set(target)) if ckpt[p] != target[p]]
  return (_listed(f"{what} Variables missing from the checkpoint", missing)
          + _listed(f"checkpoint Variables the {what} does not have", extra)
          + _listed(f"{what} Variables that differ", changed))


def _describe_recipe(layer: dict) -> str:
  hist = layer["amax_history_len"]
  return (f"{layer['type']} recipe {layer['recipe']!r} ({layer['scaling']}"
          + (f" scaling, amax_history_len={hist})" if hist else " scaling)"))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
  return out


def _layer_diff(ckpt: dict, target: dict) -> list[str]:
  missing = [f"{p or '(model)'}: {_describe_recipe(target[p])}"
             for p in sorted(set(target) - set(ckpt))]
  extra = [f"{p or '(model)'}: {_describe_recipe(ckpt[p])}"
           for p in sorted(set(ckpt) - set(target))]
  changed = []
  for p in sorted(set(ckpt) & set(target)):
    c, t = ckpt[p], target[p]
    fc, ft = _flat(c["recipe_config"]), _flat(t["recipe_config"])
    fields = [f"{k}: {fc.get(k)!r} vs {ft.get(k)!r}"
              for k in sorted(set(fc) | set(ft)) if fc.get(k) != ft.get(k)]
    if c["state"] != t["state"]:
      fields.append(f"state shapes {c['state']} vs {t['state']}")
    if c["type"] != t["type"]:
      fields.append(f"layer type {c['type']} vs {t['type']}")
    if fields:
      changed.append(f"{p or '(model)'}: checkpoint {_describe_recipe(c)}, "
                     f"model {_describe_recipe(t)}; " + "; ".join(fields))
  return (_listed("layers quantized in the model but not in the checkpoint",
                  missing)
          + _listed("layers quantized in the checkpoint but not in the model",
                    extra)
          + _listed("layers whose recipe or state differ", changed))


def _mismatch(path, lines: list[str],
              hint: str = "") -> CheckpointMismatchError:
  return CheckpointMismatchError(
      f"Checkpoint {path} does not match the target:\n" + "\n".join(lines)
      + (f"\n{hint}" if hint else ""))


def _reset_quant_state(model: nnx.Module) -> None:
  """Fresh delayed-scaling state (as a newly built layer has), keeping the
  stacked shape of layers made under nnx.vmap."""
  for _, node in gemms(model):
    if node.delayed:
      fresh = QuantGemm(node.recipe, batch_shape=node.x_amax.shape)
      nnx.update(node, nnx.state(fresh))


def restore(path: str | os.PathLike, model: nnx.Module, *,
            optimizer: nnx.Optimizer | None = None,
            params_only: bool | None = None, verify: bool = True) -> dict:
  """Restores a checkpoint written by `save` into ``model`` (and
  ``optimizer``), in place.

  Everything is checked against the metadata before any array is read; on
  a mismatch nothing is changed and `CheckpointMismatchError` lists the
  differences. The Variables other than quantization state (Params, batch
  statistics, ...) must always match in path, type, shape and dtype.

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
    verify: check every file's SHA-256 against the metadata before reading
      (``False``: check only that the files exist with their saved sizes).

  Returns:
    The checkpoint's metadata, with ``"restored"`` set to ``"full"`` or
    ``"params_only"``.

  Raises:
    FileNotFoundError: nothing at ``path``.
    CheckpointCorruptError: ``path`` is not a complete qlayers checkpoint,
      or orbax cannot read it.
    CheckpointMismatchError: the checkpoint does not fit the target.
  """
  _check_model(model)
  meta = read_metadata(path)
  path = pathlib.Path(path).expanduser().absolute()
  if params_only not in (None, True, False):
    raise TypeError("params_only must be None, True or False.")
  target = _describe(model, optimizer)
  saved, want = meta["variables"], target["variables"]

  lines = _variable_diff("model", saved.get("model", {}), want["model"])
  if lines:
    raise _mismatch(path, lines)
  if optimizer is not None:
    if "optimizer" not in saved:
      raise _mismatch(path, ["the checkpoint holds no optimizer state "
                             "(restore without optimizer=)"])
    lines = _variable_diff("optimizer", saved["optimizer"], want["optimizer"])
    if lines:
      raise _mismatch(path, lines, "The optimizer must be built like the "
                      "saved one (same optax transformation and wrapper, "
                      "same model Params).")

  layers_c, layers_t = meta["layers"], target["layers"]
  if params_only is None:
    params_only = not (layers_c and layers_t)
  if not params_only:
    lines = (_layer_diff(layers_c, layers_t)
             or _variable_diff("model", saved.get("quant", {}), want["quant"]))
    if lines:
      raise _mismatch(path, lines, "To load only the Params and start the "
                      "quantization state fresh, pass params_only=True.")

  # Read everything first, so a damaged item leaves the target untouched.
  needed = {"model"} | ({"optimizer"} if optimizer is not None else set())
  if not params_only:
    needed.add("quant")
  needed &= set(meta["items"])
  _verify_files(path, meta, needed, verify)
  rest, quant = _split(model)
  rest = _restore_item(path / "model", rest)
  quant = None if params_only else _restore_item(path / "quant", quant)
  opt = None if optimizer is None else _restore_item(path / "optimizer",
                                                     nnx.state(optimizer))
  nnx.update(model, rest)
  if params_only:
    _reset_quant_state(model)
  else:
    nnx.update(model, quant)
  if optimizer is not None:
    nnx.update(optimizer, opt)
  return {**meta, "restored": "params_only" if params_only else "full"}


def _check_model(model) -> None:
  if not isinstance(model, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(model).__name__}.")
