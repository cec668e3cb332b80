"""qlayers.fields.check_fields: each field against its annotation."""

import dataclasses
import re
from typing import Literal

import numpy as np
import pytest

from qlayers.fields import check_fields


@dataclasses.dataclass
class Opts:
  flag: bool = False
  size: int | None = None
  mode: Literal["a", "b"] = "a"


def test_check_fields_names_the_field_and_refuses_lookalikes():
  check_fields(Opts(flag=np.bool_(True), size=np.int32(3), mode="b"))
  check_fields(Opts())
  for kwargs, error, message in [
      ({"flag": "false"}, TypeError, "Opts.flag must be bool, got 'false'"),
      ({"size": True}, TypeError, "Opts.size must be int or None, got True"),
      ({"size": 2.0}, TypeError, "Opts.size must be int or None"),
      ({"mode": "c"}, ValueError, "Opts.mode must be 'a' | 'b', got 'c'"),
      ({"mode": 1}, TypeError, "Opts.mode must be 'a' | 'b', got 1 (int)"),
  ]:
    with pytest.raises(error, match=re.escape(message)):
      check_fields(Opts(**kwargs))
