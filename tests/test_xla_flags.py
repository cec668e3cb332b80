"""The suite's XLA:CPU flags (`_support.xla_flags`) leave the pinned
encodings as a user's default flags make them."""

import json
import os
import subprocess
import sys

from _support import pinned_encodings
from _support import multidevice
from _support import xla_flags


def test_the_suite_flags_are_set_in_this_process():
  have = os.environ["XLA_FLAGS"].split()
  assert set(xla_flags.flags()) <= set(have)


def test_encodings_are_the_same_under_xla_default_flags():
  """Every cast and every shipped operand spec's payload and scales, bit for
  bit: compiled here under the suite's flags, and in a fresh interpreter
  under XLA's defaults (the suite's flags removed)."""
  env = multidevice.env(devices=1)
  env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split()
                              if f not in xla_flags.flags())
  proc = subprocess.run([sys.executable, "-m", "_support.pinned_encodings"],
                        env=env, capture_output=True, text=True, timeout=600,
                        cwd=multidevice.TESTS, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  default = json.loads(proc.stdout.splitlines()[-1])
  here = pinned_encodings.digests()
  assert len(here) >= 20  # 7 casts, every distinct spec of the recipes
  assert default.keys() == here.keys()
  assert {k for k in here if here[k] != default[k]} == set()
