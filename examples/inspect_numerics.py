"""Which layers suffer under FP8/MX, and why: ``qlayers.inspect`` on the
example models.

  python examples/inspect_numerics.py                       # GPT, 3 recipes
  python examples/inspect_numerics.py --model smollm2 --steps 20 --every 5 \\
      --seq-len 64                                          # SmolLM2 fine-tune
  python examples/inspect_numerics.py --sensitivity mxfp4   # rank GPT layers

Statistics mode (the default): for each ``--recipes`` entry, trains the model
as ``train_lm.py`` (GPT from scratch) or ``finetune_smollm2.py`` (SmolLM2)
does, while a ``qlayers.inspect.Monitor`` records the per-layer statistics
of one fixed validation batch every ``--every`` steps (outside the training
step, which is compiled without it). At the end ``qlayers.inspect.collect``
measures the trained model. Writes, per recipe, into ``--out``:
``{model}_{recipe}.png`` (operand SQNR, GEMM output SQNR, saturation and
underflow per layer), ``{model}_{recipe}_amax.png`` and ``_sqnr.png`` (over
steps, for the ``--plot-layers`` layers), ``{model}_{recipe}_history.png`` (the
stored amax histories, delayed scaling only), ``{model}_{recipe}.json``
(the final report and every monitored step) and ``.csv`` (the monitored
steps).

Sensitivity mode (``--sensitivity RECIPE``, GPT): trains the BF16 baseline
for ``--steps`` (exactly ``train_lm.py``'s bf16 run of ``--seed``), then
``qlayers.inspect.sensitivity`` quantizes one layer and one GEMM at a time
on ``--batches`` validation batches, ranks the layers and proposes rules;
the proposal's pattern goes to ``train_lm.py --keep-wide`` for a parity run.
Writes ``gpt_sensitivity_{recipe}.json``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

import qlayers
from _common import cli, lm, shakespeare, training
import finetune_smollm2
import train_lm

MODELS = ("gpt", "smollm2")
DEFAULT_SIZES = {"gpt": (32, 128), "smollm2": (4, 128)}  # batch, seq_len


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    model: ``gpt`` (``train_lm.py``'s GPT, default settings) or ``smollm2``
      (``finetune_smollm2.py``'s fine-tune).
    recipes: recipes to inspect (statistics mode).
    steps: training steps per recipe (GPT: from scratch; SmolLM2: fine-tune;
      sensitivity mode: the BF16 baseline's steps).
    every: record the statistics every so many steps (and at the end).
    seed: initialisation (GPT) and data order.
    batch_size, seq_len: 0 takes the script's default (GPT 32 x 128,
      SmolLM2 4 x 128).
    d_model, n_layers, heads: GPT size (``train_lm.py``'s defaults).
    blocks: SmolLM2 only: keep the first N blocks (0: all 30).
    plot_layers: regex of the layers drawn over steps (default: the first
      and the last block).
    sensitivity: rank the GPT's layers for this recipe instead.
    batches: validation batches for ``--sensitivity``.
    max_wide: proposals keep up to this many layers wide.
    gemms: ``--sensitivity`` also measures each GEMM of each layer alone.
    out: output folder.
    progress: show progress bars.
  """

  model: str = "gpt"
  recipes: tuple[str, ...] = ("fp8_delayed", "mxfp8", "mxfp4")
  steps: int = 300
  every: int = 50
  seed: int = 0
  batch_size: int = 0
  seq_len: int = 0
  d_model: int = 128
  n_layers: int = 4
  heads: int = 4
  blocks: int = 0
  plot_layers: str | None = None
  sensitivity: str | None = None
  batches: int = 4
  max_wide: int = 4
  gemms: bool = True
  out: str = "out/inspect"
  progress: bool = True

  def sizes(self) -> tuple[int, int]:
    b, t = DEFAULT_SIZES[self.model]
    return self.batch_size or b, self.seq_len or t


def parse_args(argv=None) -> Config:
  # The description: the docstring's first paragraph, on one line.
  about = " ".join(__doc__.split("\n\n")[0].split())
  p = cli.parser(Config, about, model={"choices": MODELS},
                 recipes={"help": "comma-separated; available: "
                                  + cli.recipes()})
  args = vars(p.parse_args(argv))
  cli.check(p, args, at_least={"steps": 1, "every": 1, "batch_size": 0,
                               "seq_len": 0, "d_model": 2, "n_layers": 1,
                               "heads": 1, "blocks": 0, "batches": 1,
                               "max_wide": 1})
  if args["sensitivity"]:
    cli.check(p, {"recipes": (args["sensitivity"],)})
    if args["model"] != "gpt":
      p.error("--sensitivity runs on --model gpt")
  return Config(**args)


def loss_fn(model, inputs, targets):
  """Next-token loss."""
  return lm.next_token_loss(model(inputs), targets)


# --- the two models ----------------------------------------------------------


def gpt_config(cfg: Config) -> train_lm.Config:
  """The ``train_lm.py`` settings of the GPT runs."""
  b, t = cfg.sizes()
  return train_lm.Config(steps=cfg.steps, batch_size=b, seq_len=t,
                         d_model=cfg.d_model, layers=cfg.n_layers,
                         heads=cfg.heads, seeds=(cfg.seed,),
                         eval_batches=max(4, cfg.batches))


def train_lm_flags(cfg: Config) -> str:
  """``train_lm.py`` flags for the GPT trained here, where they differ from
  its defaults."""
  lcfg, default = gpt_config(cfg), train_lm.Config()
  return "".join(
      f" --{k.replace('_', '-')} {getattr(lcfg, k)}" for k in (
          "steps", "batch_size", "seq_len", "d_model", "layers", "heads")
      if getattr(lcfg, k) != getattr(default, k))


def gpt_setup(cfg: Config, recipe: str):
  """(model, optimizer, training batches, probe batch, validation batches)
  exactly as ``train_lm.py`` builds them for ``recipe`` and ``cfg.seed``."""
  b, t = cfg.sizes()
  lcfg = gpt_config(cfg)
  data = train_lm.load_data(lcfg)
  model, _ = train_lm.build_model(lcfg, recipe, cfg.seed)
  opt = qlayers.Optimizer(model, train_lm.make_tx(lcfg))
  stream = shakespeare.batches(data["train"], batch_size=b, seq_len=t,
                               seed=cfg.seed)
  return model, opt, stream, data["valid"][0], data["valid"]


def smollm2_setup(cfg: Config, recipe: str):
  """As ``finetune_smollm2.py``: the pretrained model converted to
  ``recipe``, its optimizer, training batches and a validation batch."""
  b, t = cfg.sizes()
  fcfg = finetune_smollm2.Config(recipe=recipe, steps=cfg.steps, batch_size=b,
                                 seq_len=t, blocks=cfg.blocks, seed=cfg.seed)
  model, tok, _ = finetune_smollm2.load_model(fcfg)
  qlayers.quantize(model, recipe)
  opt = qlayers.Optimizer(model, finetune_smollm2.make_tx(fcfg))
  train = np.asarray(tok.encode(shakespeare.load_text("train")).ids, np.int32)
  valid = np.asarray(tok.encode(shakespeare.load_text("valid")[:16 * b * t]
                                ).ids, np.int32)
  stream = shakespeare.batches(train, batch_size=b, seq_len=t, seed=cfg.seed)
  probe = next(shakespeare.batches(valid, batch_size=b, seq_len=t, seed=1))
  return model, opt, stream, probe, [probe]


def default_layers(model) -> str:
  """The first and the last block."""
  n = len(model.blocks)
  return f"^blocks/(0|{n - 1})/"


# --- statistics mode ---------------------------------------------------------


def summary(report: qlayers.inspect.Report) -> str:
  """Per role: median and worst SQNR, largest underflow and saturation, with
  the layers; per GEMM: median and worst output SQNR."""
  lines = []
  for role in ("x", "w", "g"):
    rows = [r for r in report.rows if r.role == role]
    if not rows:
      continue
    worst = min(rows, key=lambda r: r.sqnr_db)
    under = max(rows, key=lambda r: r.underflow)
    sat = max(rows, key=lambda r: r.saturated)
    lines.append(
        f"  {role}: SQNR median {np.median([r.sqnr_db for r in rows]):.1f} dB,"
        f" worst {worst.sqnr_db:.1f} ({worst.path}, {worst.gemm}); underflow"
        f" max {100 * under.underflow:.2f}% ({under.path}); saturated max "
        f"{100 * sat.saturated:.3f}% ({sat.path})")
  for gemm in ("fprop", "dgrad", "wgrad"):
    outs = [o for o in report.outputs if o.gemm == gemm]
    if outs:
      worst = min(outs, key=lambda o: o.sqnr_db)
      lines.append(f"  {gemm} output: SQNR median "
                   f"{np.median([o.sqnr_db for o in outs]):.1f} dB, worst "
                   f"{worst.sqnr_db:.1f} ({worst.path})")
  return "\n".join(lines)


def inspect_recipe(cfg: Config, recipe: str, out: pathlib.Path
                   ) -> dict[str, Any]:
  setup = gpt_setup if cfg.model == "gpt" else smollm2_setup
  model, opt, stream, probe, _ = setup(cfg, recipe)
  layers = cfg.plot_layers or default_layers(model)
  mon = qlayers.inspect.Monitor(loss_fn, every=cfg.every)
  losses, t0 = [], time.perf_counter()
  for step in training.progress(cfg.steps, f"{cfg.model} {recipe}",
                                enabled=cfg.progress):
    mon(step - 1, model, *probe)  # statistics before this step's update
    inputs, targets = next(stream)
    losses.append(float(lm.train_step(model, opt, inputs, targets)))
  final = qlayers.inspect.collect(model, loss_fn, *probe)
  mon.add(cfg.steps, final)
  seconds = time.perf_counter() - t0
  name = f"{cfg.model}_{recipe}"
  final.plot(out / f"{name}.png", title=(
      f"{cfg.model}, {recipe}, after {cfg.steps} steps (validation batch)"))
  mon.plot(out / f"{name}_amax.png", layers=layers, stat="amax")
  mon.plot(out / f"{name}_sqnr.png", layers=layers, stat="sqnr_db")
  mon.to_csv(out / f"{name}.csv")
  if qlayers.recipe(recipe).delayed:
    qlayers.inspect.plot_amax_history(model, out / f"{name}_history.png",
                                      layers=layers)
  last = losses[-10:]
  span = f"last {len(last)} steps" if len(last) > 1 else "last step"
  print(f"\n== {cfg.model} under {recipe}: {len(final.paths)} layers, "
        f"train loss {np.mean(last):.4f} ({span}), probe loss "
        f"{final.loss:.4f}; {seconds:.0f} s")
  print(summary(final))
  if len(final.paths) <= 24:
    print(final.table())
  results = {"recipe": recipe, "steps": cfg.steps, "seconds": seconds,
             "train_loss": losses, "final": final.to_dict(),
             "monitor": qlayers.inspect.report.jsonable(mon.records)}
  (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
  return results


# --- sensitivity mode ----------------------------------------------------------


def sensitivity(cfg: Config, out: pathlib.Path) -> dict[str, Any]:
  model, opt, stream, _, valid = gpt_setup(cfg, "bf16")
  t0 = time.perf_counter()
  for _ in training.progress(cfg.steps, "gpt bf16", enabled=cfg.progress):
    inputs, targets = next(stream)
    lm.train_step(model, opt, inputs, targets)
  trained = time.perf_counter() - t0
  res = qlayers.inspect.sensitivity(model, loss_fn, valid[:cfg.batches],
                                    cfg.sensitivity, max_wide=cfg.max_wide,
                                    gemms=cfg.gemms)
  seconds = time.perf_counter() - t0 - trained
  print(res.table())
  if res.proposed is not None:
    print(f"\nparity run of the proposal:\n  PYTHONPATH=. python "
          f"examples/train_lm.py --recipes {cfg.sensitivity} --keep-wide "
          f"'{res.proposed.pattern}' --seeds 0,1,2{train_lm_flags(cfg)}")
  print(f"training {trained:.0f} s, sensitivity {seconds:.0f} s")
  data = {"config": dataclasses.asdict(cfg), "train_s": trained,
          "sensitivity_s": seconds, **res.to_dict()}
  path = out / f"gpt_sensitivity_{cfg.sensitivity}.json"
  path.write_text(json.dumps(data, indent=1) + "\n")
  print(f"wrote {path}")
  return data


def main(argv=None) -> dict[str, Any]:
  cfg = parse_args(argv)
  out = pathlib.Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"on {jax.default_backend()}")
  if cfg.sensitivity:
    return sensitivity(cfg, out)
  return {r: inspect_recipe(cfg, r, out) for r in cfg.recipes}


if __name__ == "__main__":
  main(sys.argv[1:])
