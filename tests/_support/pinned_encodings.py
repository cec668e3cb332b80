"""Every encoding the library pins, as digests: run as a script, it prints
them as JSON (tests/test_xla_flags.py runs it under XLA's default flags and
compares with the suite's own process, which compiles under `xla_flags`).

One jitted program computes them all (one compile): `formats.cast` of every
element format on special and random values, and `scaling.quantize` of one
BF16 tensor by every distinct operand spec of the shipped recipes, its
payload and scales (a fixed key where the spec rounds stochastically).
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import qlayers
from qlayers import formats
from qlayers import scaling
from qlayers.recipe import available_recipes

_SPECIAL = [0.0, -0.0, 1e-10, -1e-10, 1e-3, -1e-3, 0.5, 1.5, 2.5, -2.5, 3.0,
            6.0, 7.0, 448.0, 464.0, 57344.0, 61440.0, 1e6, -1e6, np.inf,
            -np.inf, np.nan]


def _specs() -> dict:
  """Every distinct operand spec of the shipped recipes, by where it is
  first met (``recipe/gemm/side``)."""
  specs = {}
  for name in available_recipes():
    r = qlayers.recipe(name)
    for gemm in ("fprop", "dgrad", "wgrad"):
      for side in ("lhs", "rhs"):
        spec = getattr(getattr(r, gemm), side)
        if spec is not None and spec not in specs.values():
          specs[f"{name}/{gemm}/{side}"] = spec
  return specs


def _digest(*arrays) -> str:
  h = hashlib.sha256()
  for a in arrays:
    a = np.asarray(a)
    h.update(str(a.dtype).encode())
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def digests() -> dict[str, str]:
  """``{what: sha256 prefix of its bits}`` for every cast and spec."""
  rng = np.random.default_rng(0)
  scale = np.exp2(rng.integers(-20, 20, 4096))
  values = np.concatenate([np.asarray(_SPECIAL, np.float32),
                           (rng.standard_normal(4096) * scale)
                           .astype(np.float32)])
  x = jnp.asarray(rng.standard_normal((128, 256)) * 3, jnp.bfloat16)
  fmts = [f for f in formats.FORMATS if f != "e8m0"]  # E8M0: scales only
  specs = _specs()

  @jax.jit
  def encode(values, x, key):
    casts = {f: formats.cast(values, f) for f in fmts}
    quantized = {}
    for where, spec in specs.items():
      k = key if spec.rounding == "stochastic" else None
      q = scaling.quantize(x, spec, -1, key=k)
      quantized[where] = (q.payload, q.scale)
    return casts, quantized

  casts, quantized = encode(values, x, jax.random.key(7))
  out = {f"cast/{f}": _digest(c) for f, c in casts.items()}
  out.update({f"quantize/{w}": _digest(*pq) for w, pq in quantized.items()})
  return out


if __name__ == "__main__":
  print(json.dumps(digests()))
