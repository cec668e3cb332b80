"""The XLA flags the suite compiles under (conftest.py sets them for every
test and its subprocesses; tests/golden/make_golden.py for the golden file).

Compiling is nearly all of the suite's time, not running: XLA:CPU compiles
a program about a third faster with its backend (LLVM) optimizations off,
and, on jaxlib 0.10 (CI's), about a third faster again with its older fusion
code generator in place of the MLIR one. That flag is set only where it is
known to exist: jaxlib 0.11 removed it, and an unknown flag is fatal.
Nothing in the suite times the programs it runs: every test compares
programs compiled under these flags with each other, or with values stored
from them. tests/test_xla_flags.py checks that the flags change none of the
encodings the library pins (`_support.pinned_encodings`).
"""

from __future__ import annotations

import importlib.metadata
import os


def flags() -> list[str]:
  """The flags, for the installed jaxlib."""
  out = ["--xla_backend_optimization_level=0"]
  major, minor = (int(p) for p in
                  importlib.metadata.version("jaxlib").split(".")[:2])
  if (major, minor) == (0, 10):
    out.append("--xla_cpu_use_fusion_emitters=false")
  return out


def apply() -> None:
  """Adds `flags` to ``XLA_FLAGS`` (before JAX starts its CPU backend)."""
  have = os.environ.get("XLA_FLAGS", "").split()
  os.environ["XLA_FLAGS"] = " ".join(
      have + [f for f in flags() if f not in have])
