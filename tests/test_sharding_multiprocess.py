"""Two processes x 4 CPU devices (jax.distributed on localhost) train FSDP
like one process with 8 devices, and save and restore a checkpoint across
processes (multiprocess_cases.py does the work)."""

import json
import subprocess
import sys

import pytest

from _support import multidevice

TIMEOUT = 600


def _launch(out, ckpt, *extra, devices):
  return subprocess.Popen(
      [sys.executable, str(multidevice.HERE / "multiprocess_cases.py"),
       str(out), str(ckpt), *map(str, extra)],
      env=multidevice.env(devices), cwd=ckpt,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs):
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=TIMEOUT)[0])
    except subprocess.TimeoutExpired:
      p.kill()
      logs.append(p.communicate()[0] + "\n[killed after timeout]")
  return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  return multidevice.once("multiprocess", tmp_path_factory,
                          lambda: _run_all(tmp_path_factory))


def _run_all(tmp_path_factory):
  out = {}
  port = multidevice.free_port()
  root = tmp_path_factory.mktemp("multiprocess")
  (root / "one").mkdir()
  (root / "two").mkdir()
  single = _launch(root / "one.json", root / "one", devices=8)
  pair = [_launch(root / "two.json", root / "two", port, i, devices=4)
          for i in range(2)]
  logs = _finish([single, *pair])
  for name, f in (("one", root / "one.json"), ("two", root / "two.json"),
                  ("two_1", root / "two.json.1")):
    out[name] = json.loads(f.read_text()) if f.exists() else None
  out["logs"] = logs
  return out


def _get(runs, name):
  if runs[name] is None:
    pytest.fail(f"{name} wrote nothing:\n" + "\n".join(
        log[-3000:] for log in runs["logs"]), pytrace=False)
  return runs[name]


def test_two_processes_train_like_one(runs):
  one, two = _get(runs, "one"), _get(runs, "two")
  assert (one["process_count"], two["process_count"]) == (1, 2)
  assert one["devices"] == two["devices"] == 8
  # The same partitioned program; only the all-reduce implementation
  # (gloo across processes) differs.
  assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)


def test_two_processes_repeat_their_steps_bit_for_bit(runs):
  # Collectives across processes (gloo) and threads: no order that varies
  # from run to run (8 steps, where a reported nondeterminism began at 7).
  for name in ("one", "two"):
    first, second = _get(runs, name)["repeated"]
    assert first == second, (name, first, second)


def test_checkpoint_across_processes(runs):
  one, two = _get(runs, "one"), _get(runs, "two")
  assert one["checkpoint"]["ok"], one["checkpoint"]
  other = runs["two_1"] or {}
  assert two.get("checkpoint", {}).get("ok"), (
      two.get("checkpoint"), other.get("checkpoint"))
  assert two["checkpoint"]["losses"] == pytest.approx(
      one["checkpoint"]["losses"], rel=1e-6)
