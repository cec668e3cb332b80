"""Train-step time of quantized variants against the BF16 baseline.

Usage (from the repository root)::

  python benchmarks/step.py --model transformer --steps 5 --rounds 5
  python benchmarks/step.py --model mlp --steps 5 --rounds 5 --json out.json
  python benchmarks/step.py --model moe --steps 5 --rounds 5    # MoE GPT

Runs the unquantized BF16 step (``bf16``: stock ``nnx.Linear``, BF16 result
type; the ratios' baseline), the same step with FP32-accumulating linears
(``bf16-f32acc``: the second reference, see ``models.py``), every peer
library that imports (see ``benchmarks/requirements-peers.txt``) and every
qlayers recipe that quantizes, all on the same stock model, seed and batch,
and prints a Markdown table (see ``harness.py`` for the method).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))
# An installed qlayers wins; otherwise the source tree next to benchmarks/.
sys.path.append(str(_HERE.parent))

import harness  # noqa: E402
import models  # noqa: E402
import peers  # noqa: E402

_QLAYERS_API = ("quantize", "value_and_grad", "Optimizer")
# The second baseline: nnx.Linear accumulating in FP32, as quantized GEMMs do.
F32ACC = "bf16-f32acc"


# ==========================================================================
# qlayers hook. Each recipe becomes one variant:
#
#   model = models.build_model(cfg, seed=seed)          # the stock model
#   qlayers.quantize(model, recipe, rules=())           # swaps every nnx.Linear
#                                                       # in place (the head
#                                                       # too, as the peers do)
#   opt = qlayers.Optimizer(model, models.make_tx(cfg))
#   @nnx.jit
#   def train_step(model, opt, batch):
#     loss, grads = qlayers.value_and_grad(models.loss_fn)(model, batch)
#     opt.update(model, grads)      # params through optax, qstate written
#     return loss
#
# ``recipe`` is a recipe name (one of ``qlayers.available_recipes()``, or the
# stem of a file in recipes/*.toml) and is passed as given; by default every
# recipe that quantizes runs. ``rules=()`` replaces qlayers' default rules,
# which would keep the output head wide: every variant quantizes the same
# GEMMs.
# If ``import qlayers`` fails or the package lacks any of _QLAYERS_API, the
# hook returns no variants and a reason, which the report prints.
# ==========================================================================


def _qlayers_recipe_names(qlayers: Any) -> list[str]:
  """Every shipped recipe that quantizes (bf16/fp16 are unquantized)."""
  lister = getattr(qlayers, "available_recipes", None)
  if callable(lister):
    names = [str(n) for n in lister()]
  else:
    names = sorted(p.stem for p in (_HERE.parent / "recipes").glob("*.toml"))
  return [n for n in names if qlayers.recipe(n).quantized]


def _qlayers_variant(qlayers: Any, recipe: str) -> harness.Variant:
  def make(cfg: models.Config, *, seed: int = 0):
    model = models.build_model(cfg, seed=seed)
    report = qlayers.quantize(model, recipe, rules=())
    n_linear = len(report.converted) + len(report.skipped) + len(
        report.kept_wide)
    # The MoE model's router stays wide beside its experts, by design.
    wide_ok = isinstance(cfg, models.MoEConfig) and all(
        "router" in k.path for k in report.kept_wide)
    if (report.skipped or (report.kept_wide and not wide_ok)
        or not report.converted):
      raise RuntimeError(f"qlayers.quantize converted {len(report.converted)}"
                         f" of {n_linear} linear layers: {report}")
    opt = qlayers.Optimizer(model, models.make_tx(cfg))
    return models.train_step_for(model, opt,
                                 value_and_grad=qlayers.value_and_grad)

  return harness.Variant(f"qlayers-{recipe}", "qlayers", recipe, make)


def qlayers_variants(
    recipes: list[str] | None = None,
) -> tuple[list[harness.Variant], str | None]:
  """``(variants, None)``, or ``([], why)`` when qlayers cannot be used."""
  try:
    import qlayers
  except Exception as e:  # noqa: BLE001 - any import failure means "skip"
    return [], f"import qlayers failed: {type(e).__name__}: {e}"
  missing = [n for n in _QLAYERS_API if not hasattr(qlayers, n)]
  if missing:
    return [], f"qlayers lacks {', '.join(missing)} (not implemented yet)"
  names = recipes if recipes is not None else _qlayers_recipe_names(qlayers)
  if not names:
    return [], "no qlayers recipes found"
  return [_qlayers_variant(qlayers, r) for r in names], None


# ==========================================================================


def _config(args: argparse.Namespace) -> models.Config:
  overrides = {k: v for k, v in dict(
      d_model=args.d_model, n_layers=args.layers, batch=args.batch,
      learning_rate=args.lr).items() if v is not None}
  if args.model in ("transformer", "moe"):
    overrides.update({k: v for k, v in dict(
        n_heads=args.heads, seq_len=args.seq, vocab=args.vocab,
        d_ff=args.d_hidden).items() if v is not None})
    if args.model == "moe":
      return models.MoEConfig(**overrides)
    return models.TransformerConfig(**overrides)
  if args.d_hidden is not None:
    overrides["d_hidden"] = args.d_hidden
  return models.MLPConfig(**overrides)


def _positive(s: str) -> int:
  n = int(s)
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
  return n


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", choices=("transformer", "mlp", "moe"),
                 default="transformer",
                 help="moe: the MoE GPT of examples/_common/moe.py at the "
                 "transformer's sizes (8 experts, top 2; no peers: their "
                 "swaps reach nnx.Linear only, not the experts)")
  p.add_argument("--steps", type=_positive, default=5,
                 help="timed steps per variant per round")
  p.add_argument("--rounds", type=_positive, default=5,
                 help="interleaved rounds (variant order rotates)")
  p.add_argument("--check-steps", type=_positive, default=10,
                 help="untimed steps (compile + warm-up) before timing; "
                 "the loss after them is the sanity check")
  p.add_argument("--loss-rtol", type=float, default=0.1,
                 help="allowed relative distance to the baseline's loss")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--only", default=None,
                 help="comma-separated variant names to run (baseline "
                 "always runs)")
  p.add_argument("--no-peers", action="store_true")
  p.add_argument("--no-f32acc", action="store_true",
                 help=f"leave out the second baseline ({F32ACC})")
  p.add_argument("--no-qlayers", action="store_true")
  p.add_argument("--qlayers-recipes", default=None,
                 help="comma-separated recipe names (default: all)")
  p.add_argument("--json", default=None, metavar="PATH",
                 help="also write the report as JSON ('-' for stdout)")
  p.add_argument("--append-md", default=None, metavar="PATH",
                 help="append the Markdown report to this file")
  g = p.add_argument_group("model size (defaults in models.py)")
  g.add_argument("--d-model", type=int)
  g.add_argument("--d-hidden", type=int, help="MLP width / transformer d_ff")
  g.add_argument("--heads", type=int)
  g.add_argument("--layers", type=int)
  g.add_argument("--seq", type=int)
  g.add_argument("--vocab", type=int)
  g.add_argument("--batch", type=int)
  g.add_argument("--lr", type=float)
  return p


def main(argv: list[str] | None = None) -> int:
  p = _parser()
  args = p.parse_args(argv)
  recipes = ([r.strip() for r in args.qlayers_recipes.split(",") if r.strip()]
             if args.qlayers_recipes else None)
  if recipes and not args.no_qlayers:
    try:  # a misspelt recipe stops here, not after the baseline has run
      import qlayers
    except Exception:  # noqa: BLE001 - qlayers_variants reports it
      pass
    else:
      for r in recipes:
        try:
          qlayers.recipe(r)
        except ValueError as e:
          p.error(f"--qlayers-recipes: {e}")
  cfg = _config(args)
  log = lambda s: print(s, file=sys.stderr, flush=True)

  variants = [
      harness.Variant("bf16", "none",
                      "unquantized nnx.Linear: BF16 operands, BF16 result",
                      models.baseline_step),
      harness.Variant(F32ACC, "none",
                      "unquantized: BF16 operands, FP32 accumulation",
                      models.baseline_f32acc_step)]
  if args.no_f32acc:
    variants = variants[:1]
  skipped: dict[str, str] = {}
  if args.model == "moe":
    skipped["peers"] = ("MoE experts are lax.ragged_dot, not nnx.Linear: "
                        "the peers' swaps would quantize attention only")
  elif not args.no_peers:
    ok, missing = peers.available_peers()
    variants += ok
    skipped.update(missing)
  if not args.no_qlayers:
    q_variants, why = qlayers_variants(recipes)
    variants += q_variants
    if why is not None:
      skipped["qlayers"] = why
      log(f"qlayers variants skipped: {why}")
  if args.only:
    keep = set(args.only.split(","))
    unknown = keep - {v.name for v in variants}
    if unknown:
      log(f"--only: no variant named {sorted(unknown)}")
      return 2
    variants = [variants[0]] + [v for v in variants[1:] if v.name in keep]

  versions = peers.peer_versions()
  if any(v.library == "qlayers" for v in variants):
    import qlayers
    versions["qlayers"] = str(getattr(qlayers, "__version__", "source tree"))
  report = harness.run(
      cfg, variants, models.make_batch(cfg, seed=args.seed),
      steps=args.steps, rounds=args.rounds, check_steps=args.check_steps,
      seed=args.seed, loss_rtol=args.loss_rtol,
      title=f"Train step, {cfg.kind} (BF16 baseline vs FP8/MX variants)",
      versions=versions, skipped=skipped, references=[F32ACC], log=log)
  # With --json -, stdout carries the JSON alone.
  harness.publish(harness.render_markdown(report), args.append_md,
                  file=sys.stderr if args.json == "-" else None)
  if args.json:
    text = json.dumps(harness.to_json(report), indent=2)
    if args.json == "-":
      print(text)
    else:
      pathlib.Path(args.json).write_text(text + "\n")
  failed = [r.name for r in report.results if r.error is not None]
  bad = [r.name for r in report.results
         if r.error is None and not r.loss_ok]
  if failed:
    log(f"failed: {', '.join(failed)}")
  if bad:
    log(f"sanity check failed for: {', '.join(bad)}")
  return 1 if failed or bad else 0


if __name__ == "__main__":
  sys.exit(main())
