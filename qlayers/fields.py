"""Type checks of dataclass fields against their annotations.

The one validation of field types for `qlayers.scaling.QuantSpec` and the
recipe dataclasses (`qlayers.recipe`): a TOML file or a keyword argument
with a value of the wrong type is refused with the class and field named.
`positive_int` checks a count argument the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import Literal

import numpy as np

__all__ = ["check_fields", "positive_int"]


def positive_int(value, what: str) -> int:
  """``value`` as an int >= 1: any integer (NumPy's too), not a bool;
  otherwise a ValueError naming ``what``.

  Example:
    >>> import numpy as np
    >>> positive_int(np.int64(2), "n")
    2
  """
  try:
    count = -1 if isinstance(value, bool) else operator.index(value)
  except TypeError:
    count = -1
  if count < 1:
    raise ValueError(f"{what} must be a positive int, got {value!r}.")
  return count


def _is_union(tp) -> bool:
  return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


def _type_name(tp) -> str:
  if typing.get_origin(tp) is Literal:
    return " | ".join(repr(a) for a in typing.get_args(tp))
  if _is_union(tp):
    return " or ".join(_type_name(a) for a in typing.get_args(tp))
  return "None" if tp is type(None) else tp.__name__


def _matches(value, tp) -> bool:
  if typing.get_origin(tp) is Literal:
    return any(type(value) is type(a) and value == a
               for a in typing.get_args(tp))
  if _is_union(tp):
    return any(_matches(value, a) for a in typing.get_args(tp))
  if tp is bool:
    return isinstance(value, (bool, np.bool_))
  if tp is int:  # bool is an int subclass; True is not a length
    return (isinstance(value, (int, np.integer))
            and not isinstance(value, (bool, np.bool_)))
  if tp is typing.Any:
    return True
  return isinstance(value, tp)


def check_fields(obj) -> None:
  """Checks every field of the dataclass ``obj`` against its annotation.

  The one type check of `QuantSpec`, `qlayers.recipe.GemmRecipe` and
  `qlayers.recipe.Recipe`: ``bool`` fields take only booleans (not the
  string ``"false"``), ``int`` fields refuse booleans, ``Literal`` fields
  take their listed values only; a NumPy integer or boolean
  (``np.int64(16)``) in an ``int`` or ``bool`` field is stored as its
  Python value. Raises TypeError (wrong type) or ValueError
  (a value not listed) naming the field.

  Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Opts:
    ...   pow2: bool = False
    >>> check_fields(Opts(pow2="false"))
    Traceback (most recent call last):
    TypeError: Opts.pow2 must be bool, got 'false' (str).
  """
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    value, tp = getattr(obj, f.name), hints[f.name]
    if not _matches(value, tp):
      # Right type, value not among a Literal's: a ValueError.
      error = (ValueError if any(type(value) is type(a)
                                 for a in _literal_values(tp)) else TypeError)
      raise error(
          f"{type(obj).__name__}.{f.name} must be {_type_name(tp)}, got "
          f"{value!r} ({type(value).__name__}).")
    if isinstance(value, np.generic):  # np.int64(16) -> 16: JSON, TOML
      object.__setattr__(obj, f.name, value.item())


def _literal_values(tp) -> tuple:
  if typing.get_origin(tp) is Literal:
    return typing.get_args(tp)
  if _is_union(tp):
    return sum((_literal_values(a) for a in typing.get_args(tp)), ())
  return ()
