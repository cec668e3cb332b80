"""The seed's memory equation: ``python benchmarks/memory.py calc ...``.

Per device, GB = 1e9 bytes: ``M_persistent = P/N_F (4 master + m + v)``,
``M_gradient = P/N_F * 4``, ``M_saved = 2 A_h + A_e (b/8 + s/k)``.

Example::

  python benchmarks/memory.py calc --params 70e9 --fsdp 8 --recipe mxfp4 \\
      --saved-elems 2e9 --wide-elems 1e9
  python benchmarks/memory.py calc --check-seed
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

import mdtable
from memory_common import GB, SEED_BYTES

__all__ = ["MemoryEstimate", "memory_equation", "saved_bytes_per_element",
           "add_parser", "run"]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of the seed's memory equation."""

  persistent: float
  gradient: float
  saved: float
  workspace: float

  @property
  def total(self) -> float:
    return self.persistent + self.gradient + self.saved + self.workspace


def memory_equation(params: float, fsdp: int = 1, *, wide_elems: float = 0.0,
                    eligible_elems: float = 0.0,
                    eligible_bytes: float = 2.0, moments: str = "fp32",
                    workspace: float = 0.0) -> MemoryEstimate:
  """The seed's expected per-device memory.

  Args:
    params: parameter count ``P``.
    fsdp: FSDP degree ``N_F`` (parameters, gradients and moments sharded).
    wide_elems: ``A_h``, saved elements that stay BF16 (2 bytes).
    eligible_elems: ``A_e``, saved elements in the low-precision form.
    eligible_bytes: ``b/8 + s/k`` bytes per eligible element.
    moments: ``fp32`` (4 + 4 bytes) or ``bf16`` (2 + 2, as DeepSeek-V3).
    workspace: bytes of compiler/backend workspace to add.

  Example:
    >>> e = memory_equation(70e9, 8)
    >>> round(e.persistent / 1e9), round(e.gradient / 1e9)
    (105, 35)
  """
  if moments not in ("fp32", "bf16"):
    raise ValueError(f"moments must be 'fp32' or 'bf16', got {moments!r}")
  if fsdp < 1:
    raise ValueError(f"fsdp must be >= 1, got {fsdp}")
  m = 4.0 if moments == "fp32" else 2.0
  shard = params / fsdp
  return MemoryEstimate(persistent=shard * (4.0 + 2 * m),
                        gradient=shard * 4.0,
                        saved=(2.0 * wide_elems
                               + eligible_elems * eligible_bytes),
                        workspace=workspace)


def saved_bytes_per_element(name: str) -> tuple[float, str]:
  """Bytes per eligible saved element for a format or a qlayers recipe name.

  A format name of the seed's table (``bf16``, ``fp8``, ``mxfp8``, ``mxfp6``,
  ``mxfp4``) gives its value; otherwise the recipe's Wgrad input spec decides
  (2 bytes when it keeps ``x`` wide).
  """
  if name in SEED_BYTES:
    return SEED_BYTES[name], "seed table"
  import qlayers
  from qlayers import scaling
  r = qlayers.recipe(name)
  if not (r.quantized and r.save_quantized_wgrad_input
          and r.wgrad.lhs is not None):
    return float(np.dtype(r.dtype).itemsize), f"recipe {r.name} (wide x)"
  return scaling.bytes_per_element(r.wgrad.lhs), f"recipe {r.name} wgrad.x"


def run(args: argparse.Namespace) -> int:
  """The ``calc`` command."""
  if args.check_seed:
    return _check_seed()
  bpe, why = saved_bytes_per_element(args.recipe)
  eligible = args.saved_elems
  if args.tokens is not None:
    if args.d_model is None or args.d_ff is None:
      print("--tokens needs --d-model and --d-ff", file=sys.stderr)
      return 2
    # Inputs of Q/K/V (one shared tensor), O, up (d_model) and down (d_ff).
    eligible += args.layers * args.tokens * (3 * args.d_model + args.d_ff)
  est = memory_equation(args.params, args.fsdp, wide_elems=args.wide_elems,
                        eligible_elems=eligible, eligible_bytes=bpe,
                        moments=args.moments, workspace=args.workspace_gb * GB)
  bf16 = memory_equation(args.params, args.fsdp, wide_elems=args.wide_elems,
                         eligible_elems=eligible, eligible_bytes=2.0,
                         moments=args.moments, workspace=args.workspace_gb * GB)
  m = "4+4" if args.moments == "fp32" else "2+2"
  print(f"P = {args.params:.4g}, N_F = {args.fsdp}, moments {args.moments}, "
        f"A_h = {args.wide_elems:.4g} (BF16), A_e = {eligible:.4g} at "
        f"{bpe:g} B/elem ({why})\n")
  print("\n".join(mdtable.head(
      ["term", "formula", "GB per device", "with BF16 saved"], "llrr")))
  rows = [
      ("persistent", f"P/N_F x (4 master + {m} moments)", est.persistent,
       bf16.persistent),
      ("gradient", "P/N_F x 4", est.gradient, bf16.gradient),
      ("saved", f"2 A_h + A_e x {bpe:g}", est.saved, bf16.saved),
      ("workspace", "given", est.workspace, bf16.workspace),
      ("total", "", est.total, bf16.total),
  ]
  for name, formula, v, vb in rows:
    print(mdtable.row(name, formula, f"{v / GB:.2f}", f"{vb / GB:.2f}"))
  if bf16.saved:
    print(f"\nsaved / BF16 saved = {est.saved / bf16.saved:.3f}")
  return 0


def _check_seed() -> int:
  """Reproduces the seed's figures; exit status 1 if one is off."""
  from qlayers import scaling
  from qlayers.scaling import QuantSpec
  ok = True
  e = memory_equation(70e9, 8)
  print("70B parameters, FSDP-8, FP32 master + Adam moments:")
  for name, v, want in (("persistent", e.persistent, 105e9),
                        ("gradient", e.gradient, 35e9)):
    good = abs(v - want) < 0.5e9
    ok &= good
    print(f"  {name}: {v / GB:.1f} GB (seed: about {want / GB:.0f} GB) "
          f"{'ok' if good else 'MISMATCH'}")
  e = memory_equation(70e9, 8, moments="bf16")
  print(f"  persistent with BF16 moments: {e.persistent / GB:.1f} GB")
  print("\nBytes per eligible element (seed table vs "
        "qlayers.scaling.bytes_per_element):")
  specs = {"bf16": None, "fp8": QuantSpec(format="e4m3"),
           "mxfp8": QuantSpec(format="e4m3", granularity="mx"),
           "mxfp6": QuantSpec(format="e2m3", granularity="mx"),
           "mxfp4": QuantSpec(format="e2m1", granularity="mx")}
  for name, spec in specs.items():
    lib = scaling.bytes_per_element(spec)
    good = lib == SEED_BYTES[name]
    ok &= good
    print(f"  {name}: seed {SEED_BYTES[name]:.5f} ({SEED_BYTES[name] / 2:.3f}"
          f" of BF16), library {lib:.5f} {'ok' if good else 'MISMATCH'}")
  return 0 if ok else 1


def add_parser(sub) -> None:
  """The ``calc`` subcommand's flags."""
  c = sub.add_parser("calc", help="the seed's memory equation")
  c.add_argument("--params", type=float, default=70e9)
  c.add_argument("--fsdp", type=int, default=8)
  c.add_argument("--moments", choices=("fp32", "bf16"), default="fp32")
  c.add_argument("--saved-elems", type=float, default=0.0,
                 help="A_e: saved elements eligible for low precision")
  c.add_argument("--wide-elems", type=float, default=0.0,
                 help="A_h: saved elements that stay BF16")
  c.add_argument("--recipe", default="bf16",
                 help="bf16|fp8|mxfp8|mxfp6|mxfp4 or a qlayers recipe name")
  c.add_argument("--workspace-gb", type=float, default=0.0)
  c.add_argument("--tokens", type=float, default=None,
                 help="add A_e of a transformer: layers x tokens x "
                 "(3 d_model + d_ff) (inputs of QKV, O, up, down)")
  c.add_argument("--layers", type=int, default=1)
  c.add_argument("--d-model", type=int, default=None)
  c.add_argument("--d-ff", type=int, default=None)
  c.add_argument("--check-seed", action="store_true",
                 help="reproduce the seed's figures (70B, FSDP-8)")
