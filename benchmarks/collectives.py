"""Collectives of a compiled XLA program, read from its optimized HLO text.

`collectives(hlo_text)` lists every all-gather, all-reduce, reduce-scatter,
all-to-all and collective-permute with its result dtype(s) and the bytes of
its result on one device: for an all-gather the gathered buffer, for an
all-reduce the reduced one, for a reduce-scatter the local shard it leaves.
Async pairs count once (the ``-start``). A collective inside a loop body
counts once, not once per iteration: measure programs without loops over
layers. `summary` totals them by (op, dtype).
"""

from __future__ import annotations

import collections
import re

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
       "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_INSTR = re.compile(
    # A tuple type of 6+ arrays carries "/*index=5*/" comments (with "=").
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|[\w]+\[[^\]]*\]"
    r"(?:\{[^}]*\})?)\s+(?P<op>" + "|".join(OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _arrays(type_text: str):
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue  # token[] and other non-arrays
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    yield dtype, n * _DTYPE_BYTES[dtype]


def collectives(hlo_text: str) -> list[dict]:
  """``[{"op", "dtype", "bytes"}]``, one entry per array a collective moves."""
  out = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    arrays = list(_arrays(m.group("type")))
    if m.group("start") and m.group("op") in ("all-gather",
                                              "collective-permute"):
      # An async start's tuple holds the operand and the result: keep the
      # result (the last array).
      arrays = arrays[-1:]
    for dtype, nbytes in arrays:
      out.append({"op": m.group("op"), "dtype": dtype, "bytes": nbytes})
  return out


def summary(hlo_text: str) -> dict[str, dict[str, int]]:
  """``{op: {dtype: bytes}}`` totals of `collectives`."""
  total: dict[str, dict[str, int]] = collections.defaultdict(
      lambda: collections.defaultdict(int))
  for c in collectives(hlo_text):
    total[c["op"]][c["dtype"]] += c["bytes"]
  return {op: dict(v) for op, v in total.items()}


def total_bytes(hlo_text: str, op: str | None = None) -> int:
  """Bytes of all collectives (or of one kind ``op``)."""
  return sum(c["bytes"] for c in collectives(hlo_text)
             if op is None or c["op"] == op)
