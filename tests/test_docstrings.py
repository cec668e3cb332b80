"""The examples in public docstrings run and print what they show."""

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import qlayers


def _modules():
  """qlayers and its public Python modules (not the native library)."""
  names = ["qlayers"] + [
      m.name for m in pkgutil.walk_packages(qlayers.__path__, "qlayers.")
      if not m.name.rsplit(".", 1)[-1].startswith("_")]
  return sorted(n for n in names
                if importlib.util.find_spec(n).origin.endswith(".py"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS
                           | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{name}: {result.failed} failing examples"
