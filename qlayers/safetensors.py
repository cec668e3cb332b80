"""Reading and writing Hugging Face safetensors checkpoints, FP8 included.

The file format (huggingface/safetensors): an 8-byte little-endian header
length ``n``, ``n`` bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the data
(offsets relative to its start, row-major, little-endian). A sharded
checkpoint is a folder with ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {name: file}}``) beside its
``config.json``.

FP8 checkpoints as DeepSeek-V3 and Qwen3-*-FP8 ship them: a linear weight
``W (out, in)`` is stored ``F8_E4M3`` beside ``W_scale_inv``, one FP32 (or
UE8M0, ``F8_E8M0``) dequantization factor per 128 x 128 block (the last
blocks partial), and ``config.json`` has ``"quantization_config":
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``; ``W ~= W_fp8 * scale_inv`` blockwise.

Parsed here with numpy and json (no torch, no safetensors package).
"""

from __future__ import annotations

import json
import math
import operator
import os
import pathlib
import struct
import warnings
from typing import Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qlayers import scaling
from qlayers.scaling import QTensor, QuantSpec

__all__ = ["read_safetensors", "read_config", "write_safetensors",
           "read_file", "write_file", "SafetensorsError", "DTYPES",
           "SCALE_SUFFIX"]

SCALE_SUFFIX = "_scale_inv"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8), "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_FP8 = DTYPES["F8_E4M3"]
_E8M0 = DTYPES["F8_E8M0"]


class SafetensorsError(ValueError):
  """A safetensors checkpoint that cannot be read as asked (the message
  names the file and tensor)."""


# ----------------------------------------------------------------------------
# Files


def read_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of one ``.safetensors`` file as stored (no FP8 handling),
  checked against the file's size (each tensor's bytes within the data, no
  two tensors' bytes overlapping); see `write_file` for an example."""
  path = pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise SafetensorsError(f"{path}: truncated file ({size} bytes, no "
                             "header length).")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
      raise SafetensorsError(f"{path}: truncated file: header of {n} bytes "
                             f"but the file has {size}.")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise SafetensorsError(f"{path}: the header is not JSON ({e}).") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: the header is a JSON "
                           f"{type(header).__name__}, not an object of "
                           "tensors.")
  data = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else (
      np.zeros(0, np.uint8))
  out, spans = {}, []
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if not isinstance(info, dict) or not {"dtype", "shape",
                                          "data_offsets"} <= set(info):
      raise SafetensorsError(f"{path}: tensor {name!r} lacks dtype, shape "
                             f"or data_offsets in the header: {info!r}.")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
      raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype "
                             f"{info['dtype']!r} (known: {sorted(DTYPES)}).")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2
            and offsets[0] <= offsets[1]):
      raise SafetensorsError(f"{path}: tensor {name!r} has shape {shape!r} "
                             f"and data_offsets {offsets!r}; they must be "
                             "non-negative integers, [begin, end] in order.")
    shape, (begin, end) = tuple(shape), offsets
    want = math.prod(shape) * dtype.itemsize
    if end - begin != want:
      raise SafetensorsError(f"{path}: tensor {name!r} {info['dtype']} "
                             f"{shape} needs {want} bytes, its offsets give "
                             f"{end - begin}.")
    if end > data.size:
      raise SafetensorsError(f"{path}: truncated file: tensor {name!r} ends "
                             f"at byte {end} of the data, which has "
                             f"{data.size}.")
    spans.append((begin, end, name))
    out[name] = np.array(data[begin:end]).view(dtype).reshape(shape)
  spans.sort()
  for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
    if b1 < e0:
      raise SafetensorsError(f"{path}: tensors {n0!r} (bytes {b0}..{e0}) and "
                             f"{n1!r} (bytes {b1}..{e1}) overlap in the data; "
                             "each tensor needs bytes of its own.")
  return out


def _naturals(x) -> bool:
  """A JSON list of non-negative integers."""
  return isinstance(x, list) and all(
      isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def _index(path: pathlib.Path) -> dict[str, str]:
  """``weight_map`` of the shard index in folder ``path`` (tensor -> shard
  file), checked."""
  try:
    index = json.loads((path / INDEX).read_text())
  except ValueError as e:
    raise SafetensorsError(f"{path / INDEX} is not JSON ({e}).") from None
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not (isinstance(weight_map, dict) and all(
      isinstance(v, str) for v in weight_map.values())):
    raise SafetensorsError(f"{path / INDEX} has no weight_map of tensor "
                           "names to shard files.")
  return weight_map


def _files(path: pathlib.Path) -> list[pathlib.Path]:
  if path.is_file():
    return [path]
  if (path / INDEX).is_file() and not _single_wins(path):
    names = sorted(set(_index(path).values()))
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
      raise SafetensorsError(f"{path / INDEX} names shards that are "
                             f"missing: {missing}.")
    return [path / n for n in names]
  if (path / SINGLE).is_file():
    return [path / SINGLE]
  raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX} (nor a "
                          ".safetensors file at that path).")


def _single_wins(path: pathlib.Path) -> bool:
  """Whether folder ``path`` is read from ``model.safetensors`` though it
  holds an index too: where the index names other shards, the single file
  is read, as Hugging Face's loaders read such a folder (with a warning)."""
  if not (path / SINGLE).is_file():
    return False
  names = set(_index(path).values())
  if names == {SINGLE}:
    return False
  warnings.warn(f"{path} holds both {SINGLE} and {INDEX} (shards "
                f"{', '.join(sorted(names)[:2])}, ...); reading {SINGLE}, as "
                "Hugging Face's loaders do.", stacklevel=4)
  return True


def read_config(path: str | os.PathLike) -> dict:
  """``config.json`` of the checkpoint at ``path`` (a folder, or a file in
  it); ``{}`` if there is none.

  Raises:
    SafetensorsError: the file is not JSON, not a JSON object, or its
      ``quantization_config`` is not an object.
  """
  path = pathlib.Path(path)
  folder = path if path.is_dir() else path.parent
  f = folder / CONFIG
  if not f.is_file():
    return {}
  try:
    config = json.loads(f.read_text())
  except ValueError as e:
    raise SafetensorsError(f"{f} is not JSON ({e}).") from None
  if not isinstance(config, dict):
    raise SafetensorsError(f"{f} is a JSON {type(config).__name__}, not an "
                           "object.")
  q = config.get("quantization_config")
  if q is not None and not isinstance(q, dict):
    raise SafetensorsError(f"{f}: quantization_config is a JSON "
                           f"{type(q).__name__} ({q!r}), not an object.")
  return config


def _block(config: Mapping) -> tuple[int, int]:
  q = config.get("quantization_config") or {}
  block = q.get("weight_block_size") or [128, 128]
  if not (isinstance(block, (list, tuple)) and len(block) == 2
          and _naturals(list(block)) and min(block) > 0):
    raise SafetensorsError(f"quantization_config.weight_block_size must be "
                           f"[rows, cols] of positive integers, got "
                           f"{block!r}.")
  return tuple(block)


# ----------------------------------------------------------------------------
# Reading


def _scale_grid(name, w, s, block, where) -> np.ndarray:
  """The FP32 scale grid of FP8 weight ``name``, checked: finite and
  non-negative (a zero scale is allowed: an all-zero block)."""
  want = tuple(-(-n // b) for n, b in zip(w.shape, block))
  if s.dtype not in (DTYPES["F32"], _E8M0):
    raise SafetensorsError(f"{where}: {name}{SCALE_SUFFIX} has dtype "
                           f"{_NAMES.get(s.dtype, s.dtype)}; FP8 block "
                           "scales are F32 or F8_E8M0.")
  if s.shape != want:
    raise SafetensorsError(
        f"{where}: {name}{SCALE_SUFFIX} has shape {s.shape}; weight {name} "
        f"{w.shape} in {block[0]}x{block[1]} blocks needs {want}.")
  s = s.astype(np.float32)  # E8M0 decodes exactly (powers of two)
  bad = ~np.isfinite(s) | (s < 0)
  if bad.any():
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    raise SafetensorsError(
        f"{where}: {name}{SCALE_SUFFIX} has {s[i]} at block {i}; block "
        "scales must be finite and non-negative (zero for an all-zero "
        "block).")
  return s


def _dequantize(w: np.ndarray, s: np.ndarray, block) -> np.ndarray:
  full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)
  return w.astype(np.float32) * full[:w.shape[0], :w.shape[1]]


def _qtensor(w: np.ndarray, s: np.ndarray, block) -> QTensor:
  padded = tuple(g * b for g, b in zip(s.shape, block))
  payload = np.zeros(padded, _FP8)
  payload[:w.shape[0], :w.shape[1]] = w
  return QTensor(jnp.asarray(payload), jnp.asarray(s), "e4m3", "block",
                 tuple(block), 1, tuple(w.shape))


def read_safetensors(path: str | os.PathLike, quantized: bool = False
                     ) -> dict[str, np.ndarray | QTensor]:
  """Reads a safetensors checkpoint: one file, or a folder (one
  ``model.safetensors`` or shards with ``model.safetensors.index.json``).

  An ``F8_E4M3`` weight ``W`` with ``W_scale_inv`` (block sizes from
  ``config.json``'s ``quantization_config.weight_block_size``, default
  128 x 128; scales ``F32`` or ``F8_E8M0``) comes back under ``W``:
  dequantized exactly to FP32 (each element ``fp8 * scale`` rounded once),
  or with ``quantized=True`` as a `qlayers.scaling.QTensor` (payload padded
  with zeros to whole blocks, FP32 scales, granularity ``"block"``,
  ``axis=1``, ``shape`` the stored ``(out, in)``). Everything else comes
  back as stored (numpy arrays; BF16 as ``ml_dtypes.bfloat16``).

  Raises:
    SafetensorsError: an FP8 weight without its scale (or a scale without
      its weight), a scale of the wrong shape or dtype, or with a NaN,
      infinite or negative block (zero is allowed), an unknown dtype, a
      truncated file, a malformed header (tensors' bytes overlapping among
      them), ``config.json``, block size or shard index (one placing a
      tensor in a shard that does not hold it). With an index each tensor
      is read from the shard it names (others' copies and tensors it does
      not list are not read); a folder holding ``model.safetensors`` and an
      index of other shards is read from ``model.safetensors`` (with a
      warning), as Hugging Face's loaders read it.

  Example:
    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> w = np.linspace(-1, 1, 200 * 130, dtype=np.float32).reshape(200, 130)
    >>> _ = write_safetensors(d, {"proj.weight": w, "norm.weight": w[0]})
    >>> got = read_safetensors(d)["proj.weight"]
    >>> got.dtype, float(abs(got - w).max()) < 1 / 16
    (dtype('float32'), True)
    >>> read_safetensors(d, quantized=True)["proj.weight"].payload.shape
    (256, 256)
  """
  path = pathlib.Path(path)
  block = _block(read_config(path))
  files = _files(path)
  index = (_index(path) if path.is_dir() and (path / INDEX).is_file()
           and files != [path / SINGLE] else None)
  raw, where = {}, {}
  for f in files:
    for name, t in read_file(f).items():
      # With an index, each tensor from the shard it names (a copy in
      # another shard, or a tensor it does not list, is not read: Hugging
      # Face's loaders go by the index too).
      if index is None or path / index.get(name, "") == f:
        raw[name], where[name] = t, f
  if index is not None:
    stray = {n: s for n, s in index.items() if n not in raw}
    if stray:
      raise SafetensorsError(
          f"{path / INDEX} places tensors in shards that do not hold "
          f"them: "
          + ", ".join(f"{n} -> {s}" for n, s in list(stray.items())[:5])
          + (f" and {len(stray) - 5} more" if len(stray) > 5 else "") + ".")
  out = {}
  for name, t in raw.items():
    if name.endswith(SCALE_SUFFIX):
      if name[:-len(SCALE_SUFFIX)] not in raw:
        raise SafetensorsError(f"{where[name]}: {name} has no weight "
                               f"{name[:-len(SCALE_SUFFIX)]!r}.")
      continue
    scale = raw.get(name + SCALE_SUFFIX)
    if t.dtype != _FP8:
      if scale is not None:
        raise SafetensorsError(f"{where[name]}: {name} has a {SCALE_SUFFIX} "
                               f"but is {_NAMES[t.dtype]}, not F8_E4M3.")
      out[name] = t
      continue
    if scale is None:
      raise SafetensorsError(
          f"{where[name]}: FP8 weight {name} has no {name}{SCALE_SUFFIX}; "
          "without it the weight is off by its block scales.")
    if t.ndim != 2:
      raise SafetensorsError(f"{where[name]}: FP8 weight {name} has shape "
                             f"{t.shape}; block scales need a 2-D weight.")
    s = _scale_grid(name, t, scale, block, where[name])
    out[name] = _qtensor(t, s, block) if quantized else _dequantize(t, s,
                                                                    block)
  return out


# ----------------------------------------------------------------------------
# Writing


def _wide_float(dtype) -> bool:
  """FP16 and wider, BF16 among them (ml_dtypes' types are not
  ``np.floating``)."""
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2


def _default_fp8(name: str, x) -> bool:
  low = name.lower()
  return (np.ndim(x) == 2 and name.endswith(".weight")
          and _wide_float(np.asarray(x).dtype)
          and not any(k in low for k in ("embed", "norm", "lm_head")))


def _block_arg(block) -> tuple[int, int]:
  """``fp8_block`` as ``(rows, cols)``: an int ``n`` is ``(n, n)``, as
  `QuantSpec`'s ``block_size`` is a square block."""
  def index(v):
    if isinstance(v, bool):  # operator.index takes True as 1
      raise TypeError
    return operator.index(v)
  try:
    block = (index(block),) * 2 if not isinstance(block, (tuple, list)) else (
        tuple(index(b) for b in block))
  except TypeError:
    raise TypeError(f"fp8_block must be an int n (n x n blocks), (rows, "
                    f"cols) of ints, or None; got {block!r}.") from None
  if len(block) != 2 or min(block) < 1:
    raise ValueError(f"fp8_block must be (rows, cols) of positive ints, got "
                     f"{block}.")
  return block


def _fp8_pair(name, t, block, scale_format) -> dict[str, np.ndarray]:
  """``{name: F8_E4M3 payload, name_scale_inv: scales}`` of a wide array
  or a block `QTensor`."""
  if not isinstance(t, QTensor):
    if block[0] != block[1]:
      raise ValueError(f"fp8_block must be square, got {block}.")
    spec = QuantSpec(format="e4m3", granularity="block",
                     block_size=block[0], pow2=scale_format == "ue8m0")
    t = scaling.quantize(jnp.asarray(t, jnp.float32), spec, axis=1)
  if (t.format != "e4m3" or t.granularity != "block" or t.ndim != 2
      or tuple(t.block) != tuple(block) or t.transposed):
    raise ValueError(f"{name}: only 2-D E4M3 QTensors in {block} blocks can "
                     f"be written; got {t.format} {t.granularity} "
                     f"{t.block} of shape {t.shape}.")
  payload = np.asarray(t.payload)[:t.shape[0], :t.shape[1]]
  scale = np.asarray(t.scale, np.float32)
  if scale_format == "ue8m0":
    m, _ = np.frexp(scale)
    if not np.all(m == 0.5):
      raise ValueError(f"{name}: scale_format='ue8m0' needs power-of-two "
                       "scales; these are not.")
    scale = scale.astype(_E8M0)
  return {name: payload, name + SCALE_SUFFIX: scale}


def write_file(path: str | os.PathLike,
               tensors: Mapping[str, np.ndarray]) -> None:
  """Writes numpy ``tensors`` as they are to the ``.safetensors`` file
  ``path`` (the header padded to 8 bytes, as the reference writer does).

  Example:
    >>> import tempfile, numpy as np
    >>> f = tempfile.mkdtemp() + "/t.safetensors"
    >>> write_file(f, {"a": np.arange(3, dtype=np.int32)})
    >>> read_file(f)["a"]
    array([0, 1, 2], dtype=int32)
  """
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, t in tensors.items():
    header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                    "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for t in tensors.values():
      f.write(np.ascontiguousarray(t).tobytes())


def _shards(groups: list[dict], max_bytes: int | None) -> list[dict]:
  """Groups (a weight with its scale) packed into shards of at most
  ``max_bytes`` (a group larger than that gets a shard of its own)."""
  shards, size = [{}], 0
  for g in groups:
    n = sum(t.nbytes for t in g.values())
    if max_bytes is not None and shards[-1] and size + n > max_bytes:
      shards.append({})
      size = 0
    shards[-1].update(g)
    size += n
  return shards


def write_safetensors(path: str | os.PathLike,
                      tensors: Mapping[str, object],
                      fp8_block: tuple[int, int] | int | None = (128, 128), *,
                      config: Mapping | None = None,
                      scale_format: str = "float32",
                      fp8_filter: Callable[[str, object], bool] | None = None,
                      max_shard_bytes: int | None = None) -> pathlib.Path:
  """Writes ``tensors`` as a Hugging Face checkpoint folder ``path``, with
  FP8 weights as DeepSeek-V3 / Qwen3-FP8 ship them; returns ``path``.

  A `QTensor` (2-D E4M3 in ``fp8_block`` blocks, as `read_safetensors`
  gives) is written as its payload and ``_scale_inv``. A wide array for
  which ``fp8_filter(name, array)`` is true (default: 2-D floating
  ``*.weight`` without ``embed``, ``norm`` or ``lm_head`` in its name) is
  quantized to E4M3 in ``fp8_block`` blocks (``scale = max(amax, 1e-4) /
  448``, or a power of two rounded up with ``scale_format="ue8m0"``, then
  stored as ``F8_E8M0``); ``fp8_block=None`` quantizes nothing, an int
  ``n`` means ``(n, n)``. Weights are in PyTorch's ``(out, in)`` order;
  everything else is written as given, except a plain E4M3 array: it has
  no scale, without which `read_safetensors` refuses it, so it raises a
  ValueError (pass a `QTensor`, payload + scales, or the wide array).

  Writes ``model.safetensors``, or with ``max_shard_bytes`` the shards
  ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``
  (a weight and its scale in one shard), and ``config.json``: ``config``
  with the ``quantization_config`` when any weight is FP8, without an FP8
  one (``quant_method`` ``"fp8"``) when none is. Files of the same layout
  are overwritten; nothing else is deleted.

  Raises:
    SafetensorsError: ``path`` holds the other layout already (an index
      where one file is to be written, or ``model.safetensors`` where
      shards are): two checkpoints in one folder; nothing is written.
    ValueError: a bad ``scale_format`` or ``fp8_block`` value, a name
      ending in ``_scale_inv``, a plain E4M3 array or a dtype safetensors
      cannot name, a `QTensor` with ``fp8_block=None`` or of another block
      or format (nothing is written then).
    TypeError: an ``fp8_block`` that is no int nor pair of ints.

  Example:
    >>> import tempfile, numpy as np
    >>> d = write_safetensors(tempfile.mkdtemp(),
    ...                       {"mlp.weight": np.ones((256, 128), np.float32)})
    >>> read_config(d)["quantization_config"]["weight_block_size"]
    [128, 128]
  """
  if scale_format not in ("float32", "ue8m0"):
    raise ValueError(f"scale_format must be 'float32' or 'ue8m0', got "
                     f"{scale_format!r}.")
  if fp8_block is not None:
    fp8_block = _block_arg(fp8_block)
  keep = fp8_filter or _default_fp8
  groups, fp8 = [], False
  for name, t in tensors.items():
    if name.endswith(SCALE_SUFFIX):
      raise ValueError(f"{name}: names ending in {SCALE_SUFFIX} are written "
                       "with their weight; pass the weight (or a QTensor).")
    if isinstance(t, QTensor) or (fp8_block is not None and keep(name, t)):
      if fp8_block is None:
        raise ValueError(f"{name} is a QTensor but fp8_block is None.")
      groups.append(_fp8_pair(name, t, fp8_block, scale_format))
      fp8 = True
    else:
      t = np.asarray(t)
      fix = ("pass a QTensor (payload + scales) or the wide array to "
             "quantize")
      if t.dtype == _FP8:
        # Written bare it would have no _scale_inv, and read_safetensors
        # refuses an F8_E4M3 weight without one.
        raise ValueError(
            f"{name}: a plain {t.dtype} array has no scale to write beside "
            f"it (read_safetensors needs {name}{SCALE_SUFFIX}); {fix}.")
      if t.dtype not in _NAMES:
        narrow = jnp.issubdtype(t.dtype, jnp.floating) and t.dtype.itemsize < 2
        raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name"
                         + (f"; {fix} to E4M3." if narrow else "."))
      groups.append({name: t})
  path = pathlib.Path(path)
  shards = _shards(groups, max_shard_bytes)
  # The other layout's files beside the new ones would make two checkpoints
  # in one folder (a reader takes one of them): refused, nothing deleted.
  other = ([INDEX] if len(shards) == 1 else [SINGLE])
  other = [n for n in other if (path / n).is_file()]
  if other:
    raise SafetensorsError(
        f"{path} holds {', '.join(other)}: writing a "
        f"{'single-file' if len(shards) == 1 else 'sharded'} checkpoint "
        "beside it would leave two checkpoints in one folder; write to "
        "another folder, or remove the old one's files first.")
  path.mkdir(parents=True, exist_ok=True)
  if len(shards) == 1:
    write_file(path / SINGLE, shards[0])
  else:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      write_file(path / fname, shard)
      weight_map.update({n: fname for n in shard})
      total += sum(t.nbytes for t in shard.values())
    (path / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map},
        indent=2))
  config = dict(config or {})
  q = config.get("quantization_config")
  if not fp8 and isinstance(q, Mapping) and q.get("quant_method") == "fp8":
    del config["quantization_config"]  # a source FP8 model's, now stale
  if fp8:
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": list(fp8_block)}
    if scale_format == "ue8m0":
      q["scale_fmt"] = "ue8m0"
    config["quantization_config"] = q
  (path / CONFIG).write_text(json.dumps(config, indent=2))
  return path
