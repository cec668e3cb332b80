"""Command-line flags from an example's ``Config`` dataclass; ``--json``.

Each example keeps its settings in a dataclass at the top of the script.
`parser` gives every field a flag (``batch_size`` -> ``--batch-size``) that
takes the field's type and default, so the dataclass is the one place where a
setting is declared.
"""

import argparse
import dataclasses
import json
import pathlib
import types
import typing
from typing import Any, Callable

import qlayers

SHARED_FLAGS = {"json": {"metavar": "PATH"}}
"""``add_argument`` keywords for fields of these names, in every example."""


def recipes() -> str:
  """The registered qlayers recipes, comma-separated (for help texts)."""
  return ", ".join(qlayers.available_recipes())


def csv(kind: type) -> Callable[[str], tuple[Any, ...]]:
  """A flag type: ``"a,b"`` -> ``(kind("a"), kind("b"))``, blanks skipped."""
  return lambda s: tuple(kind(x) for x in s.split(",") if x.strip())


def _flag(name: str, hint: Any, default: Any) -> tuple[str, dict[str, Any]]:
  """The option and ``add_argument`` keywords for one field."""
  option = "--" + name.replace("_", "-")
  if hint is bool:
    if default:
      return "--no-" + option[2:], {"action": "store_false"}
    return option, {"action": "store_true"}
  args = typing.get_args(hint)
  if (typing.get_origin(hint) in (typing.Union, types.UnionType)
      and type(None) in args and len(args) == 2):
    hint = next(a for a in args if a is not type(None))  # T | None
    args = typing.get_args(hint)
  if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is ...:
    return option, {"type": csv(args[0]), "default": default}
  if hint in (int, float, str):
    return option, {"type": hint, "default": default}
  raise TypeError(f"no flag for field {name!r} of type {hint}")


def parser(config: type, doc: str,
           **flags: dict[str, Any]) -> argparse.ArgumentParser:
  """A parser with one flag per field of the dataclass ``config``.

  ``int``, ``float`` and ``str`` fields (or ``T | None``) take one value;
  ``tuple[T, ...]`` fields take comma-separated values; a ``bool`` field
  that defaults to true becomes ``--no-NAME``, one that defaults to false
  ``--NAME``. Every flag defaults to its field's default.

  Args:
    config: a dataclass whose fields all have defaults.
    doc: the script's docstring; its first line describes the parser.
    **flags: per field name, ``add_argument`` keywords (``help``,
      ``choices``, ...) that add to or replace the derived ones.

  Returns:
    The parser; ``vars(parser.parse_args(argv))`` are the keyword arguments
    of ``config`` (plus any flags added to it afterwards).
  """
  fields = dataclasses.fields(config)
  unknown = set(flags) - {f.name for f in fields}
  if unknown:
    raise ValueError(f"{config.__name__} has no fields {sorted(unknown)}")
  hints = typing.get_type_hints(config)
  p = argparse.ArgumentParser(
      description=doc.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for f in fields:
    if f.default is dataclasses.MISSING:
      raise TypeError(f"field {f.name!r} of {config.__name__} has no default")
    option, kwargs = _flag(f.name, hints[f.name], f.default)
    kwargs.update(SHARED_FLAGS.get(f.name, {}))
    kwargs.update(flags.get(f.name, {}))
    p.add_argument(option, dest=f.name, **kwargs)
  return p


def check(p: argparse.ArgumentParser, args: dict[str, Any], *,
          at_least: dict[str, int] | None = None) -> None:
  """Stops with a usage error (exit status 2) on flags that cannot work.

  ``recipe`` / ``recipes`` values must be registered qlayers recipes or
  existing ``.toml`` files; each ``at_least`` field must be at least its
  bound (a zero batch or a negative step count otherwise fails much later,
  or trains on nothing).
  """
  names = tuple(args.get("recipes") or ()) + (
      (args["recipe"],) if args.get("recipe") else ())
  available = set(qlayers.available_recipes())
  for name in names:
    if name not in available and not pathlib.Path(name).is_file():
      p.error(f"unknown recipe {name!r}; available: {recipes()} "
              "(or a path to a recipe .toml file)")
  for name, low in (at_least or {}).items():
    if args[name] < low:
      p.error(f"--{name.replace('_', '-')} must be at least {low}, "
              f"got {args[name]}")


def parse(config: type, doc: str, argv: list[str] | None = None, *,
          at_least: dict[str, int] | None = None,
          **flags: dict[str, Any]) -> Any:
  """``config`` built from the command line ``argv``, checked with `check`;
  see `parser` for ``flags``."""
  p = parser(config, doc, **flags)
  args = vars(p.parse_args(argv))
  check(p, args, at_least=at_least)
  return config(**args)


def write_json(path: str | None, results: dict[str, Any]) -> None:
  """Writes ``results`` to ``path`` as indented JSON (nothing if no path)."""
  if not path:
    return
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=1) + "\n")
  print(f"wrote {path}")
