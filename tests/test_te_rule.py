"""The TE per-tensor rule (`te_multiplier`, `te_scale`) against the NumPy
reference on every amax class: zero, -0.0, subnormal, the overflow boundary
of ``max / amax`` (with margins), normal, huge, Inf, NaN; pow2; eager, jit
and constant-folded (the amax known when compiling)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _support import reference_numpy as ref
from qlayers import formats as F
from qlayers import scaling as S

FTZ = float(jax.jit(lambda v: v * 3.0)(np.float32(1e-40))) == 0.0
FORMATS = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]
F32 = np.float32


def _amaxes(fmt: str, margin: int) -> np.ndarray:
  vals = [0.0, -0.0, 1e-45, 3e-42, 1.1754942e-38, 2.0**-126, 1e-37, 1e-30,
          1e-4, 0.5, 1.0, 448.0, 57344.0, 3e38, float(np.finfo(F32).max),
          np.inf, np.nan]
  # max / amax overflows FP32 below about max / FLT_MAX: the eight floats on
  # either side of that boundary, and of its multiples by 2**margin.
  edge = F32(ref.fmt_max(fmt)) / np.finfo(F32).max
  for c in (edge, F32(edge * 2.0**margin)):
    v = w = F32(c)
    for _ in range(8):
      vals += [float(v), float(w)]
      v, w = np.nextafter(v, F32(0)), np.nextafter(w, F32(1))
  rng = np.random.default_rng(margin)
  vals += list(rng.lognormal(0, 20, 200))
  return np.asarray(vals, F32)


def _differ(got, want):
  """Indices where ``got`` and ``want`` differ in bits (NaN equals NaN)."""
  got = np.atleast_1d(np.asarray(got, F32))
  want = np.atleast_1d(np.asarray(want, F32))
  same = (got.view(np.uint32) == want.view(np.uint32)) | (
      np.isnan(got) & np.isnan(want))
  return np.flatnonzero(~same)


def _same(got, want, what):
  bad = _differ(got, want)
  got = np.atleast_1d(np.asarray(got, F32))
  want = np.atleast_1d(np.asarray(want, F32))
  assert not len(bad), (what, bad[:5], got[bad[:5]], want[bad[:5]])


def _expected(a, fmt, margin, pow2, ftz=FTZ):
  """The reference rule as XLA:CPU computes it: a huge amax gives a
  subnormal multiplier, flushed to zero there, whose scale is then 1 / 0."""
  mult = ref.flush(ref.te(a, fmt, margin, pow2)[0], ftz)
  with np.errstate(divide="ignore", over="ignore"):  # 1 / subnormal
    scale = ref.flush(np.float32(1) / mult, ftz)
  return mult, scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("pow2", [False, True])
def test_te_rule_matches_reference(fmt, margin, pow2):
  a = _amaxes(fmt, margin)
  f = F.get_format(fmt)
  want_mult, want_scale = _expected(ref.flush(a, FTZ), fmt, margin, pow2)

  def rule(v):
    return (S.te_multiplier(v, f, margin=margin, pow2=pow2),
            S.te_scale(v, f, margin=margin, pow2=pow2))

  for name, fn in (("eager", rule), ("jit", jax.jit(rule))):
    mult, scale = fn(jnp.asarray(a))
    _same(mult, want_mult, f"{name} multiplier")
    _same(scale, want_scale, f"{name} scale")
  # Constant-folded: XLA evaluates the rule when compiling, reading
  # subnormal amaxes as they are. Its results are flushed as at run time
  # (jax 0.10) or kept subnormal (jax 0.11): either reference pair, whole.
  folds = [_expected(a, fmt, margin, pow2), _expected(a, fmt, margin, pow2,
                                                     ftz=False)]
  # One program of twelve scalar rules, each of a constant amax, so each is
  # folded on its own (one compile, not twelve).
  picked = (0, 1, 2, 3, 4, 13, 14, 15, 16, 17, 20, 30)
  folded = jax.jit(lambda: [rule(jnp.float32(a[i])) for i in picked])()
  for i, (mult, scale) in zip(picked, folded):
    wants = [(m[i], s[i]) for m, s in folds]
    if not any(len(_differ(mult, m)) + len(_differ(scale, s)) == 0
               for m, s in wants):
      _same(mult, wants[0][0], f"folded multiplier of {a[i]}")
      _same(scale, wants[0][1], f"folded scale of {a[i]}")


def test_margin_out_of_range_is_refused():
  with pytest.raises(ValueError, match="margin"):
    S.te_multiplier(jnp.float32(1.0), F.E4M3, margin=127)
  with pytest.raises(ValueError, match="margin"):
    S.QuantSpec(format="e4m3", margin=200)
