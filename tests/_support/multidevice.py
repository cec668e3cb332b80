"""Running test code on several simulated CPU devices, in a subprocess.

JAX fixes its device count when it starts, and the suite's own process has
one CPU device, so multi-device code runs in a fresh interpreter with
``--xla_force_host_platform_device_count``. A script run this way is a list
of cases (`cases` collects them): each is called once, its JSON-able result
(or its error and traceback) is written to the file the parent reads, so one
subprocess serves a whole test module and a failing case fails only its
tests.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import traceback

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent


def env(devices: int) -> dict[str, str]:
  """The environment of a subprocess with ``devices`` CPU devices (and the
  parent's other XLA flags: the suite's, `xla_flags`)."""
  e = dict(os.environ)
  flags = [f for f in e.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  e["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={devices}"])
  e["JAX_PLATFORMS"] = "cpu"
  e["PYTHONPATH"] = os.pathsep.join(
      [str(HERE), str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH")
                                else []))
  return e


def run(script: str, *, devices: int = 8, timeout: float = 600,
        args: tuple[str, ...] = ()) -> dict:
  """Runs ``tests/<script>`` (a path below tests/) with ``devices`` devices;
  its cases' results."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "results.json"
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), str(out), *args],
        env=env(devices), capture_output=True, text=True, timeout=timeout,
        cwd=tmp, check=False)
    if proc.returncode or not out.exists():
      raise RuntimeError(f"{script} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


def once(name: str, tmp_path_factory, fn) -> dict:
  """``fn()`` (JSON-able), once per test session even under pytest-xdist:
  the first worker to ask computes it, the others wait for its result (a
  file lock in the session's shared temporary folder)."""
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    return fn()
  shared = tmp_path_factory.getbasetemp().parent
  done = shared / f"{name}.json"
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if done.exists():
        return json.loads(done.read_text())
      result = fn()
      done.write_text(json.dumps(result))
      return result
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def run_once(script: str, tmp_path_factory, **kwargs) -> dict:
  """`run` through `once`."""
  return once(pathlib.Path(script).stem, tmp_path_factory,
              lambda: run(script, **kwargs))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Cases:
  """A registry of cases for a subprocess script (see the module docstring)."""

  def __init__(self):
    self.fns = {}

  def __call__(self, fn):
    self.fns[fn.__name__] = fn
    return fn

  def main(self, argv=None):
    argv = sys.argv if argv is None else argv
    out_path = pathlib.Path(argv[1])
    only = set(argv[2:])
    results = {}
    for name, fn in self.fns.items():
      if only and name not in only:
        continue
      try:
        results[name] = {"ok": True, "value": fn()}
      except Exception as e:  # pylint: disable=broad-except
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-6000:]}
      out_path.write_text(json.dumps(results))
    out_path.write_text(json.dumps(results))


def result(results: dict, name: str):
  """The value of case ``name``; fails the test with the case's error."""
  import pytest  # pylint: disable=g-import-not-at-top
  if name not in results:
    pytest.fail(f"case {name} did not run")
  r = results[name]
  if not r["ok"]:
    pytest.fail(f"case {name} raised {r['error']}\n{r['traceback']}",
                pytrace=False)
  return r["value"]
