"""Shared test helpers (a plain module: conftest.py names collide across
test folders)."""

import numpy as np


def sqnr_db(ref, approx) -> float:
  """20*log10(|ref| / |ref - approx|) in float64."""
  r = np.asarray(ref, np.float64)
  a = np.asarray(approx, np.float64)
  err = np.linalg.norm(r - a)
  if err == 0:
    return float("inf")
  return float(20 * np.log10(np.linalg.norm(r) / err))
