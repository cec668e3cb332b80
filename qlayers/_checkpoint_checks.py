"""What `qlayers.checkpoint` checks and orbax does not: digests of the
files, and how a checkpoint differs from its target.

Digests (``qlayers.json``: size and SHA-256 of every file, and of the
qlayers description): orbax reads a flipped bit in an array's data back as
a wrong value, silently. Orbax writes a checkpoint into a temporary
directory and renames it when complete; `path_class` extends that directory
to write the digests just before the rename, so they are part of what
orbax makes atomic. The rename step itself rewrites ``_CHECKPOINT_METADATA``
(a timestamp) and writes ``commit_success.txt``: those two are covered by
the digest of the description instead. Format 2 (qlayers 0.2, before format 3) digested
every file after orbax's rename; it still reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import pathlib

import numpy as np
from flax import nnx

from qlayers.layers.core import QuantLayer, gemms
from qlayers.layers.frozen import frozen_kernels
from qlayers.recipe import Recipe

FILE = "qlayers.json"
FORMAT = "qlayers-checkpoint"
VERSION = 3
_RENAMING = ("_CHECKPOINT_METADATA", "commit_success.txt")


class CheckpointMismatchError(ValueError):
  """The checkpoint does not fit the target model or optimizer."""


class CheckpointCorruptError(ValueError):
  """The checkpoint directory is incomplete, damaged or not a checkpoint."""


# ----------------------------------------------------------------------------
# Digests


def _sha256(file: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(file, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _description_sha256(description: dict) -> str:
  text = json.dumps(description, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _write(path: pathlib.Path) -> None:
  """Writes the digests into a finished, not yet renamed checkpoint."""
  import orbax.checkpoint as ocp

  files = {rel: {"size": f.stat().st_size, "sha256": _sha256(f)}
           for f in sorted(path.rglob("*"))
           if f.is_file() and (rel := f.relative_to(path).as_posix())
           not in _RENAMING}
  description = ocp.metadata.get_step_metadata(path).custom_metadata
  with open(path / FILE, "w") as f:
    json.dump({"format": FORMAT, "format_version": VERSION, "files": files,
               "description_sha256": _description_sha256(description)}, f,
              indent=1)
    f.flush()
    os.fsync(f.fileno())


def path_class():
  """Orbax's atomic-rename temporary directory, writing the digests of a
  checkpoint (not of its items, also finalized this way) first."""
  from orbax.checkpoint.path import atomicity

  class DigestedPath(atomicity.AtomicRenameTemporaryPath):

    async def finalize(self):
      if (self.get() / _RENAMING[0]).exists():  # a checkpoint, not an item
        await asyncio.to_thread(_write, pathlib.Path(self.get()))
      await super().finalize()
  return DigestedPath


def read(path: pathlib.Path) -> tuple[dict, dict]:
  """The digests and the description (orbax's custom metadata) of the
  checkpoint at ``path``, both checked with its top-level files."""
  import orbax.checkpoint as ocp

  file = path / FILE
  if not path.exists():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  if not file.is_file():
    steps = sorted(int(p.name) for p in path.glob("*")
                   if p.name.isdigit() and (p / FILE).is_file()
                   ) if path.is_dir() else []
    raise CheckpointCorruptError(
        f"{path} is not a checkpoint directory." if not path.is_dir() else
        f"{path} holds the steps {steps} of a checkpoint.Manager, not one "
        f"checkpoint: restore one with Manager.restore or from "
        f"{path / str(steps[-1])}." if steps else
        f"{path} has no {FILE}: the save did not finish, or this is not a "
        "qlayers checkpoint.")
  try:
    digests = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointCorruptError(f"{file} is not readable JSON: {e}") from None
  if not (isinstance(digests, dict) and digests.get("format") == FORMAT
          and isinstance(digests.get("files"), dict)):
    raise CheckpointCorruptError(f"{file} is not qlayers checkpoint metadata.")
  if digests.get("format_version") not in (2, VERSION):
    raise CheckpointCorruptError(
        f"{path} has checkpoint format version "
        f"{digests.get('format_version')}; this qlayers reads versions 2 and "
        f"{VERSION}.")
  verify(path, digests, (), deep=True)
  try:
    description = dict(ocp.metadata.get_step_metadata(path).custom_metadata)
  except (OSError, ValueError, TypeError) as e:
    raise CheckpointCorruptError(f"Checkpoint {path} is damaged: orbax cannot "
                                 f"read its {_RENAMING[0]} ({e}).") from None
  if digests["format_version"] > 2 and (_description_sha256(description)
                                        != digests.get("description_sha256")):
    raise CheckpointCorruptError(
        f"Checkpoint {path} is damaged: its qlayers description in "
        f"{_RENAMING[0]} changed since it was saved (SHA-256 differs).")
  for key in ("format", "items", "layers", "has_optimizer"):
    if key not in description:
      raise CheckpointCorruptError(f"{path} lacks the qlayers description "
                                   f"({key!r}) in its orbax metadata.")
  return digests, description


def verify(path: pathlib.Path, digests: dict, items, deep: bool) -> None:
  """Checks the top-level files and those of the ``items`` directories:
  each listed one as saved (size; SHA-256 if ``deep``), none unlisted (so an
  emptied list hides nothing)."""
  files, problems = digests["files"], []
  exempt = {FILE, *(_RENAMING if digests["format_version"] > 2 else ())}
  mine = lambda rel: "/" not in rel or rel.split("/", 1)[0] in items
  for f in sorted(path.rglob("*")):
    rel = f.relative_to(path).as_posix()
    if f.is_file() and mine(rel) and rel not in files and rel not in exempt:
      problems.append(f"{rel} is not listed in {FILE}")
  for rel, rec in files.items():
    f, rec = path / rel, rec if isinstance(rec, dict) else {}
    if not mine(rel):
      continue
    if not f.is_file():
      problems.append(f"{rel} is missing")
    elif f.stat().st_size != rec.get("size"):
      problems.append(f"{rel} has {f.stat().st_size} bytes, "
                      f"{rec.get('size')} when saved")
    elif deep and _sha256(f) != rec.get("sha256"):
      problems.append(f"{rel} changed since it was saved (SHA-256 differs)")
  if problems:
    raise CheckpointCorruptError("\n".join(
        _listed(f"Checkpoint {path} is damaged", problems)))


def orbax_read(path, fn):
  """``fn()``, with orbax's and tensorstore's many errors as corruption."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    msg = (str(e).splitlines() or [type(e).__name__])[0][:300]
    raise CheckpointCorruptError(f"Could not read checkpoint {path}: "
                                 f"{msg}") from e


# ----------------------------------------------------------------------------
# Differences from the target


def check_model(obj) -> None:
  if not isinstance(obj, nnx.Module):
    raise TypeError(f"Expected an nnx.Module, got {type(obj).__name__}.")


HINTS = {"quant": "To load only the Params and start the quantization state "
                  "fresh, pass params_only=True.",
         "optimizer": "The optimizer must be built like the saved one (same "
                      "optax transformation and wrapper, same model Params)."}


def layers(model) -> dict[str, dict]:
  """Per quantized layer (or bare `QuantGemm`) of ``model``: its type and
  recipe, as the checkpoint's description records them."""
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


def frozen(model) -> dict[str, str]:
  """Per frozen kernel (`qlayers.FrozenKernel`) of ``model``: the layout
  its payload and scales are read in (element format, granularity, block).
  The two FP6 formats store alike, so shapes and dtypes alone cannot tell
  them apart."""
  out = {}
  for path, node in frozen_kernels(model):
    fmt, granularity, block = node.kernel.layout
    out["/".join(map(str, path))] = f"{fmt} {granularity} block {block}"
  return out


def frozen_diff(ckpt: dict | None, target: dict) -> list[str]:
  """Frozen kernels whose stored layout differs (checkpoints that predate
  the record: nothing to compare)."""
  if ckpt is None:
    return []
  return _listed("frozen kernels stored in another layout", [
      f"{p or '(model)'}: checkpoint {ckpt[p]}, model {target[p]}"
      for p in sorted(set(ckpt) & set(target)) if ckpt[p] != target[p]])


def _listed(title: str, items: list[str], show: int = 8) -> list[str]:
  more = [f"... and {len(items) - show} more"] if len(items) > show else []
  return [f"{title}:"] + [f"  {s}" for s in items[:show] + more] if items \
      else []


def check(path, lines: list[str], hint: str | None = None) -> None:
  """Raises `CheckpointMismatchError` listing ``lines``, if any."""
  if lines:
    raise CheckpointMismatchError(
        f"Checkpoint {path} does not match the target:\n" + "\n".join(lines)
        + (f"\n{hint}" if hint else ""))


def variable_diff(what: str, ckpt: dict, target: dict) -> list[str]:
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


def flat(tree, prefix: str = "") -> dict:
  """``{"a/b": leaf}`` of a nested ``{str: ...}`` dict."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k: v for key, sub in tree.items()
          for k, v in flat(sub, f"{prefix}/{key}" if prefix else key).items()}


# Recipe fields with a default (JSON form), for checkpoints saved before a
# field existed.
_RECIPE_DEFAULTS = {
    f.name: json.loads(json.dumps(f.default))
    for f in dataclasses.fields(Recipe)
    if f.default is not dataclasses.MISSING and isinstance(
        f.default, (str, int, float, bool, type(None)))}


_RECIPE_TEXT = ("name", "description")
_DELAYED_ONLY = ("amax_history_len", "amax_compute_algo")


def layer_diff(ckpt: dict, target: dict) -> list[str]:
  """Differences of two ``{layer path: description}`` (see
  `qlayers.checkpoint.read_metadata`), each recipe setting named."""
  def describe(layer):
    hist = layer["amax_history_len"]
    return (f"{layer['type']} recipe {layer['recipe']!r} ({layer['scaling']}"
            + (f" scaling, amax_history_len={hist})" if hist else " scaling)"))

  changed = []
  for p in sorted(set(ckpt) & set(target)):
    c, t = ckpt[p], target[p]
    fc, ft = flat(c["recipe_config"]), flat(t["recipe_config"])
    # A top-level Recipe field a checkpoint predates holds its default there.
    fc = {**{k: v for k, v in _RECIPE_DEFAULTS.items() if k not in fc}, **fc}
    # A recipe's name and description say nothing of its numerics, nor do
    # delayed scaling's settings where neither side scales delayed.
    ignored = _RECIPE_TEXT + (() if "delayed" in (c["scaling"], t["scaling"])
                              else _DELAYED_ONLY)
    fields = [f"{k.replace('/', '.')}: {fc.get(k)!r} vs {ft.get(k)!r}"
              for k in sorted(set(fc) | set(ft))
              if fc.get(k) != ft.get(k) and k not in ignored]
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
