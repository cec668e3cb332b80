"""Markdown table lines, as every benchmark report prints them.

Example::

  lines = head(["recipe", "MiB"], "lr")
  lines.append(row("bf16", f"{2.0:.1f}"))
  lines.append(row("fp8", "failed", None))  # | fp8 | failed | |
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["row", "rule", "head"]


def row(*cells: Any) -> str:
  """One line ``| a | b |``; a ``None`` cell is blank (``| |``).

  An empty string is a cell with nothing in it and prints as ``|  |``.
  """
  return "|" + "".join(" |" if c is None else f" {c} |" for c in cells)


def rule(align: str) -> str:
  """The rule under a header: ``---`` per ``l``, ``---:`` per ``r``."""
  return "|" + "".join("---:|" if a == "r" else "---|" for a in align)


def head(columns: Iterable[str], align: str) -> list[str]:
  """The header line and the rule under it; one ``align`` letter a column."""
  columns = list(columns)
  if len(columns) != len(align):
    raise ValueError(f"{len(columns)} columns, {len(align)} alignments")
  return [row(*columns), rule(align)]
