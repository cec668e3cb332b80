"""Train a small GPT on Shakespeare under FP8/MX recipes and BF16, side by side.

  python examples/train_lm.py                              # BF16 vs fp8_delayed
  python examples/train_lm.py --recipes fp8_delayed,mxfp8 --seeds 0,1,2 \\
      --json out/train_lm.json                             # parity over seeds
  python examples/train_lm.py --steps 5000 --d-model 384 --layers 6 \\
      --batch-size 64 --seq-len 256                        # a longer run (GPU)
  python examples/train_lm.py --merge out/a.json,out/b.json --out out/ab
                                                           # one table from both
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python examples/train_lm.py --mesh data=2,fsdp=4     # sharded, 8 devices
  python examples/train_lm.py --recipes mxfp4,mxfp4+wide --keep-wide auto \
      --seeds 0,1,2                  # keep wide what inspect.sensitivity proposes

Every run builds the same GPT (``_common/gpt.py``) from the same seed, so all
recipes start from identical weights and see the same batches in the same
order. The baseline keeps its ``nnx.Linear`` layers and computes them in
``--dtype`` (BF16 by default); each recipe run first swaps the linears for
qlayers layers with one call, ``qlayers.quantize(model, recipe)``, which keeps
the embedding and the output head wide. Training uses
``qlayers.value_and_grad`` and ``qlayers.Optimizer`` (AdamW, warmup + cosine
schedule, global-norm clipping) in one ``nnx.jit`` step (``lm.train_step`` in
``_common/lm.py``). Validation loss is measured on fixed batches from
held-out plays.

Outputs (in ``--out``): ``train_lm.png`` (train and validation loss per
recipe, and the validation gap to the baseline), ``train_lm.md`` (the final
table); ``--json PATH`` writes every number. With several ``--seeds`` each
recipe is compared to the baseline by the rule printed under the table.
``--merge`` trains nothing: it combines the ``--json`` files of earlier runs
with the same training settings (more seeds, more recipes) into one table,
plot and JSON, and checks that a (recipe, seed) run present in several files
gave the same numbers.

``--mesh data=2,fsdp=4`` (axes ``data``, ``fsdp``, ``model``; see
``_common/sharding.py``) shards every run over a device mesh: the batch over
``data`` and ``fsdp``, weight matrices and their optimizer state over
``fsdp`` (gathered per GEMM, as FP8 payloads in the quantized runs), and
``model`` splits the MLP matrices (tensor parallelism). The same command
runs on simulated CPU devices and on a multi-GPU host.

JAX picks the accelerator when there is one; nothing here forces the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import platform
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import qlayers
from qlayers import recipe_rules
from _common import cli, gpt, keep_wide, lm, shakespeare, sharding, training

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
BASELINE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}
WIDE = "+wide"  # suffix of a run that keeps the --keep-wide layers wide


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    recipes: qlayers recipes to train, besides the baseline.
    seeds: one run per recipe and seed (init and data order follow the seed).
    steps: optimizer steps per run.
    batch_size, seq_len: tokens per step = ``batch_size * seq_len``.
    d_model, layers, heads, d_ff: GPT size (``d_ff`` 0: ``4 * d_model``).
    lr, min_lr_ratio, warmup: peak learning rate, final lr as a fraction of
      it, linear-warmup steps (-1: 10% of ``steps``).
    weight_decay, clip, b2: AdamW decay (matrices only), global-norm clip,
      second-moment decay.
    eval_every, eval_batches: validation every so many steps (and at the
      end), on this many fixed ``batch_size x seq_len`` batches.
    dtype: computation dtype of the linear layers (the baseline's GEMM
      inputs); parameters, norms and the residual stream stay FP32.
    prompt, sample_tokens, temperature: text sampled after training (first
      seed of each recipe).
    tolerance: parity tolerance on the validation loss, in percent.
    tolerances: per-recipe tolerances, ``NAME=PERCENT``; by default the
      MXFP4 recipes, whose elements carry one mantissa bit, are held to 3%.
    out: folder for the plot and the table.
    json: also write all numbers to this file.
    progress: show progress bars.
    merge: train nothing; combine these ``--json`` files of earlier runs.
    mesh: shard over a device mesh, ``AXIS=SIZE,...`` with axes ``data``,
      ``fsdp``, ``model`` (sizes multiplying to the device count); empty:
      one device.
    keep_wide: what every recipe run keeps unquantized besides the
      embedding and the head (``_common/keep_wide.py``): a regex of module
      paths (``re.search``), ``@PATH`` (a rules file, or a
      ``qlayers.inspect.sensitivity`` JSON: its proposal), ``auto`` (the
      rules ``sensitivity`` proposes for each recipe, measured here) or
      ``noise=FRACTION`` (``qlayers.inspect.noise_fallback``: the layers
      whose weight-gradient noise exceeds FRACTION of its norm, measured
      here); those runs are named ``RECIPE+wide`` and held to ``RECIPE``'s
      tolerance. Every recipe runs wide unless ``recipes`` names a
      ``+wide`` run itself: then only those do (``--recipes
      mxfp4,mxfp4+wide`` trains both).
    calib_seed, calib_steps, calib_batches: for ``auto`` and ``noise``: the
      baseline of this seed is trained this many steps, then measured on
      this many further training batches.
    baseline_run: train the baseline (``--no-baseline-run``: only the recipes, for
      a ``--json`` file that ``--merge`` combines with one that has it).
  """

  recipes: tuple[str, ...] = ("fp8_delayed",)
  seeds: tuple[int, ...] = (0,)
  steps: int = 300
  batch_size: int = 32
  seq_len: int = 128
  d_model: int = 128
  layers: int = 4
  heads: int = 4
  d_ff: int = 0
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup: int = -1
  weight_decay: float = 0.1
  clip: float = 1.0
  b2: float = 0.95
  eval_every: int = 50
  eval_batches: int = 4
  dtype: str = "bfloat16"
  prompt: str = "ROMEO:\n"
  sample_tokens: int = 240
  temperature: float = 0.8
  tolerance: float = 1.0
  tolerances: tuple[str, ...] = ("mxfp4=3", "mxfp4_rht=3")
  out: str = "out/train_lm"
  json: str | None = None
  progress: bool = True
  merge: tuple[str, ...] = ()
  mesh: str = ""
  keep_wide: str | None = None
  calib_seed: int = 0
  calib_steps: int = 100
  calib_batches: int = 2
  baseline_run: bool = True

  @property
  def baseline(self) -> str:
    return BASELINE_NAMES[self.dtype]

  def tolerance_for(self, recipe: str) -> float:
    """The parity tolerance (%) of ``recipe``: `tolerances`, else
    `tolerance`."""
    own = parse_tolerances(self.tolerances)
    return own.get(recipe, own.get(recipe.removesuffix(WIDE),
                                   self.tolerance))

  @property
  def runs(self) -> tuple[str, ...]:
    """The baseline first, then the recipes (the baseline only once),
    named ``RECIPE+wide`` under ``keep_wide`` unless some recipe already
    is (then the names are taken as they are)."""
    explicit = any(r.endswith(WIDE) for r in self.recipes)
    wide = WIDE if self.keep_wide and not explicit else ""
    return (self.baseline,) * self.baseline_run + tuple(
        r if r.endswith(WIDE) else r + wide for r in self.recipes
        if r != self.baseline)


def parse_tolerances(items) -> dict[str, float]:
  """``("mxfp4=3", ...)`` -> ``{"mxfp4": 3.0}``; ValueError if malformed."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    try:
      out[name.strip()] = float(value)
    except ValueError:
      sep = ""
    if not sep or not name.strip() or out[name.strip()] <= 0:
      raise ValueError(f"tolerance {item!r} is not NAME=PERCENT with a "
                       "positive PERCENT")
  return out


def parse_args(argv=None) -> Config:
  """Command-line flags -> `Config` (defaults from the dataclass)."""
  p = cli.parser(
      Config, __doc__,
      recipes={"help": "comma-separated recipes; available: "
                       + cli.recipes()},
      seeds={"help": "comma-separated seeds, e.g. 0,1,2"},
      merge={"metavar": "JSONS",
             "help": "train nothing; combine these comma-separated --json "
                     "files of earlier runs into one table"},
      dtype={"choices": sorted(DTYPES)},
      mesh={"metavar": "AXIS=SIZE,...",
            "help": "shard over a device mesh of axes data, fsdp, model, "
                    "e.g. data=2,fsdp=4 (empty: one device)"})
  p.add_argument("--recipe", default=None,
                 help="one recipe (shorthand for --recipes NAME)")
  args = vars(p.parse_args(argv))
  recipe = args.pop("recipe")
  if recipe is not None:
    args["recipes"] = (recipe,)
  if any(r.endswith(WIDE) for r in args["recipes"]) and not args["keep_wide"]:
    p.error(f"--recipes: a {WIDE} run needs --keep-wide (the layers it keeps "
            "wide)")
  if args["keep_wide"]:
    try:
      keep_wide.check(args["keep_wide"])
    except ValueError as e:
      p.error(f"--keep-wide: {e}")
  named = tuple(r.removesuffix(WIDE) for r in args["recipes"])
  cli.check(p, {**args, "recipes": named}, at_least={
      "steps": 1, "batch_size": 1, "seq_len": 1, "d_model": 2, "layers": 1,
      "heads": 1, "d_ff": 0, "warmup": -1, "eval_every": 1,
      "eval_batches": 1, "sample_tokens": 0, "calib_steps": 0,
      "calib_batches": 1})
  try:
    parse_tolerances(args["tolerances"])
  except ValueError as e:
    p.error(f"--tolerances: {e}")
  if args["tolerance"] <= 0:
    p.error(f"--tolerance must be positive, got {args['tolerance']}")
  if not args["seeds"]:
    p.error("--seeds needs at least one seed")
  if args["mesh"]:
    try:
      sharding.check_batch(sharding.make_mesh(args["mesh"]),
                           args["batch_size"])
    except ValueError as e:
      p.error(f"--mesh: {e}")
  return Config(**args)


# --- model, optimizer, steps -------------------------------------------------


def gpt_config(cfg: Config) -> gpt.GPTConfig:
  return gpt.GPTConfig(
      vocab_size=shakespeare.ByteTokenizer.vocab_size, max_len=cfg.seq_len,
      d_model=cfg.d_model, n_layers=cfg.layers, n_heads=cfg.heads,
      d_ff=cfg.d_ff or 4 * cfg.d_model, dtype=DTYPES[cfg.dtype])


def build_model(cfg: Config, run: str, seed: int, rules=None):
  """The GPT for ``seed``, its linears quantized unless ``run`` is the
  baseline; a ``RECIPE+wide`` run is converted with ``rules`` (default: those
  of a regex or file ``--keep-wide``). Returns ``(model, conversion report
  or None)``."""
  model = gpt.GPT(gpt_config(cfg), rngs=nnx.Rngs(seed))
  if run == cfg.baseline:
    return model, None
  if not run.endswith(WIDE):
    report = qlayers.quantize(model, run)
  else:
    if rules is None:
      if not cfg.keep_wide or keep_wide.measured(cfg.keep_wide):
        raise ValueError(f"run {run!r} needs --keep-wide (the layers it "
                         "keeps wide) or rules measured for it")
      rules = keep_wide.fixed_rules(cfg.keep_wide)
    report = qlayers.quantize(model, run.removesuffix(WIDE), rules,
                              strict=True)
  # Step-keyed stochastic rounding (nvfp4): each GEMM its own seed.
  recipe_rules.seed_rounding(model, seed)
  return model, report


def make_tx(cfg: Config) -> optax.GradientTransformation:
  warmup = cfg.warmup if cfg.warmup >= 0 else max(1, cfg.steps // 10)
  return training.adamw_cosine(
      lr=cfg.lr, steps=cfg.steps, warmup=warmup,
      weight_decay=cfg.weight_decay, min_lr_ratio=cfg.min_lr_ratio,
      clip=cfg.clip, b2=cfg.b2)


@functools.partial(jax.jit, static_argnames="graphdef")
def _eval_loss(graphdef, state, inputs, targets):
  return lm.next_token_loss(nnx.merge(graphdef, state)(inputs), targets)


def evaluate(model, batches) -> float:
  """Mean loss over fixed ``(inputs, targets)`` batches, in eval mode."""
  with lm.eval_mode(model):
    graphdef, state = nnx.split(model)
  return float(np.mean([float(_eval_loss(graphdef, state, x, y))
                        for x, y in batches]))


# --- one run -----------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """Results of one (recipe, seed) run."""

  recipe: str
  seed: int
  train_loss: list[float]
  eval_steps: list[int]
  val_loss: list[float]
  step_ms: float
  cpu_ms: float
  tokens_per_s: float
  compile_s: float
  sample: str | None = None

  @property
  def final_train(self) -> float:
    """Mean train loss over the last 10% of steps (at least 1, at most 50)."""
    k = min(50, max(1, len(self.train_loss) // 10))
    return float(np.mean(self.train_loss[-k:]))

  @property
  def final_val(self) -> float:
    return self.val_loss[-1]


def train_run(cfg: Config, run: str, seed: int, data, tx, *,
              verbose: bool, rules=None) -> Run:
  """Trains one model; ``data`` holds the token arrays and validation set.

  Pass the same ``tx`` to every run: it is part of the optimizer's static
  structure, so a new one would make ``nnx.jit`` compile the step again.
  """
  mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
  with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
    return _train_run(cfg, run, seed, data, tx, verbose=verbose, mesh=mesh,
                      rules=rules)


def _train_run(cfg: Config, run: str, seed: int, data, tx, *, verbose: bool,
               mesh, rules=None) -> Run:
  model, report = build_model(cfg, run, seed, rules)
  if report is not None and verbose:
    tqdm.write(str(report))
  optimizer = qlayers.Optimizer(model, tx)
  stream = shakespeare.batches(data["train"], batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=seed)
  valid = data["valid"]
  if mesh is not None:
    sharding.shard_model(mesh, model, optimizer)
    stream = (sharding.put_batch(mesh, *batch) for batch in stream)
    valid = [sharding.put_batch(mesh, *batch) for batch in valid]
  tokens = cfg.batch_size * cfg.seq_len
  losses, eval_steps, val_losses, wall, cpu = [], [], [], [], []
  bar = training.progress(cfg.steps, f"{run} seed {seed}",
                          enabled=cfg.progress)
  compile_s = 0.0
  for step in bar:
    inputs, targets = next(stream)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = float(lm.train_step(model, optimizer, inputs, targets))
    t1, c1 = time.perf_counter(), time.process_time()
    if step == 1:
      compile_s = t1 - t0  # compilation plus one step
    else:
      wall.append(t1 - t0)
      cpu.append(c1 - c0)
    if not math.isfinite(loss):
      raise FloatingPointError(f"{run} seed {seed}: loss {loss} at step {step}")
    losses.append(loss)
    if step % cfg.eval_every == 0 or step == cfg.steps:
      eval_steps.append(step)
      val_losses.append(evaluate(model, valid))
    postfix = {"loss": f"{loss:.3f}"}
    if val_losses:
      postfix["val"] = f"{val_losses[-1]:.3f}"
    if wall:
      postfix["tok/s"] = f"{tokens / np.mean(wall[-20:]):,.0f}"
    bar.set_postfix(postfix, refresh=False)
  bar.close()
  step_s = float(np.mean(wall)) if wall else compile_s
  result = Run(run, seed, losses, eval_steps, val_losses,
               step_ms=1e3 * step_s,
               cpu_ms=1e3 * float(np.mean(cpu)) if cpu else float("nan"),
               tokens_per_s=tokens / step_s, compile_s=compile_s)
  if verbose and cfg.sample_tokens > 0:
    result.sample = sample(model, cfg, seed)
  return result


def sample(model, cfg: Config, seed: int) -> str:
  """``cfg.sample_tokens`` sampled characters after ``cfg.prompt``."""
  tok = shakespeare.ByteTokenizer()
  prompt = tok.encode(cfg.prompt)
  out = lm.generate(model, prompt, max_new_tokens=cfg.sample_tokens,
                    key=jax.random.key(seed), temperature=cfg.temperature)
  return tok.decode(out)


# --- summary -----------------------------------------------------------------


def _mean_std(xs) -> tuple[float, float]:
  xs = np.asarray(xs, np.float64)
  return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def verdict(diffs, tolerance: float) -> str:
  """Parity rule on per-seed relative validation-loss differences (%).

  ``m`` = mean of the paired differences (same seed: same init and data),
  ``se`` = their standard error (std / sqrt(n)). Within tolerance if
  ``|m| + 2 se <= tol``; outside if ``|m| - 2 se > tol``; otherwise more
  seeds are needed. With one seed there is no error bar: ``|m| <= tol``.
  A negative ``m`` means the recipe reached a lower loss than the baseline.
  """
  n = len(diffs)
  m, s = _mean_std(diffs)
  side = "lower" if m < 0 else "higher"
  if n == 1:
    return (f"within ±{tolerance:g}% (1 seed)" if abs(m) <= tolerance
            else f"{side} by > {tolerance:g}% (1 seed, no error bar; "
                 "try --seeds 0,1,2)")
  se = s / math.sqrt(n)
  if abs(m) + 2 * se <= tolerance:
    return f"within ±{tolerance:g}%"
  if abs(m) - 2 * se > tolerance:
    return f"outside ±{tolerance:g}% ({side} loss)"
  return "inconclusive (more seeds)"


RULE = ("Δ val: (val_recipe - val_{base}) / val_{base} per seed (same init and "
        "data order), mean ± std over seeds. Rule: with se = std/√n, a recipe "
        "is within ±{tol:g}% of {base} if |mean| + 2·se ≤ {tol:g}%, outside if "
        "|mean| - 2·se > {tol:g}%, inconclusive otherwise; with one seed, "
        "|Δ| ≤ {tol:g}% (no error bar).")


def rule_text(cfg: Config) -> str:
  """`RULE` for ``cfg``, naming the per-recipe tolerances in use."""
  text = RULE.format(base=cfg.baseline, tol=cfg.tolerance)
  named = {r.removesuffix(WIDE) for r in cfg.recipes} | set(cfg.recipes)
  own = {r: t for r, t in parse_tolerances(cfg.tolerances).items()
         if r in named}
  if own:
    text += (" Tolerance per recipe: "
             + ", ".join(f"{r} {t:g}%" for r, t in own.items()) + ".")
  return text


def summarize(cfg: Config, runs: dict[str, list[Run]]) -> dict[str, Any]:
  base = {r.seed: r.final_val for r in runs[cfg.baseline]}
  rows = {}
  for name, rs in runs.items():
    diffs = [100.0 * (r.final_val - base[r.seed]) / base[r.seed] for r in rs]
    rows[name] = {
        "train_loss": _mean_std([r.final_train for r in rs]),
        "val_loss": _mean_std([r.final_val for r in rs]),
        "val_diff_pct": _mean_std(diffs),
        "val_diff_pct_per_seed": diffs,
        "step_ms": _mean_std([r.step_ms for r in rs]),
        "cpu_ms": _mean_std([r.cpu_ms for r in rs]),
        "tokens_per_s": _mean_std([r.tokens_per_s for r in rs]),
        "verdict": ("baseline" if name == cfg.baseline
                    else verdict(diffs, cfg.tolerance_for(name))),
    }
  return rows


def _pm(ms, fmt, several):
  m, s = ms
  return f"{m:{fmt}} ± {s:{fmt.lstrip('+')}}" if several else f"{m:{fmt}}"


def markdown_table(cfg: Config, rows, *, cpu_column: bool = False) -> str:
  """The final table; ``cpu_column`` adds the process CPU time per step
  (steadier than wall time on a CPU shared with other work)."""
  several = len(cfg.seeds) > 1
  cols = ["recipe"] + (["seeds"] if several else []) + ["train loss", "val loss", f"Δ val vs {cfg.baseline}",
          "step (ms)", "tokens/s"] + (["CPU/step (ms)"] if cpu_column else [])
  lines = ["| " + " | ".join(cols + ["verdict"]) + " |",
           "|" + "---|" * (len(cols) + 1)]
  for name, r in rows.items():
    diff = ("—" if name == cfg.baseline
            else _pm(r["val_diff_pct"], "+.2f", several) + "%")
    cells = [name] + ([str(len(r["val_diff_pct_per_seed"]))] if several
                      else []) + [_pm(r["train_loss"], ".4f", several),
             _pm(r["val_loss"], ".4f", several), diff,
             _pm(r["step_ms"], ".0f", several),
             _pm(r["tokens_per_s"], ",.0f", several)]
    if cpu_column:
      cells.append(_pm(r["cpu_ms"], ".0f", several))
    lines.append("| " + " | ".join(cells + [r["verdict"]]) + " |")
  lines += ["", rule_text(cfg)]
  if cpu_column:
    lines.append("Step time: mean wall time per step after the first "
                 "(compilation); CPU/step: process CPU time (all threads).")
  return "\n".join(lines)


def plot(cfg: Config, runs: dict[str, list[Run]], path: pathlib.Path) -> None:
  """Train loss, validation loss and the validation gap, per recipe."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  base_val = {r.seed: np.asarray(r.val_loss) for r in runs[cfg.baseline]}
  steps = np.arange(1, cfg.steps + 1)
  window = max(1, cfg.steps // 30)
  for i, (name, rs) in enumerate(runs.items()):
    color = "black" if name == cfg.baseline else f"C{i - 1}"
    train = np.mean([r.train_loss for r in rs], axis=0)
    smooth = np.convolve(train, np.ones(window) / window, mode="valid")
    axes[0].plot(steps, train, color=color, alpha=0.15, lw=0.8)
    axes[0].plot(steps[window - 1:], smooth, color=color, label=name)
    es = rs[0].eval_steps
    val = np.array([r.val_loss for r in rs])
    axes[1].plot(es, val.mean(0), "o-", color=color, ms=3, label=name)
    if len(rs) > 1:
      axes[1].fill_between(es, val.min(0), val.max(0), color=color, alpha=0.2)
    if name != cfg.baseline:
      base = np.array([base_val[r.seed] for r in rs])  # paired by seed
      gap = 100.0 * (val - base) / base
      axes[2].plot(es, gap.mean(0), "o-", color=color, ms=3, label=name)
      if len(rs) > 1:
        axes[2].fill_between(es, gap.min(0), gap.max(0), color=color,
                             alpha=0.2)
  for tol in sorted({cfg.tolerance_for(r) for r in runs if r != cfg.baseline}
                    or {cfg.tolerance}):
    axes[2].axhspan(-tol, tol, color="grey", alpha=0.1, label=f"±{tol:g}%")
  axes[2].axhline(0.0, color="black", lw=0.8)
  counts = sorted({len(rs) for rs in runs.values()})
  seeds = (f"{'-'.join(map(str, counts))} seeds per recipe, mean (band: "
           "min-max)" if len(cfg.seeds) > 1 else f"seed {cfg.seeds[0]}")
  titles = (f"train loss (smoothed over {window} steps)", "validation loss",
            f"validation loss vs {cfg.baseline} (%)")
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
  lo = min(min(r.final_val for r in rs) for rs in runs.values())
  axes[0].set_ylim(lo - 0.3, lo + 2.0)
  axes[1].set_ylim(lo - 0.1, lo + 1.0)
  fig.suptitle(f"GPT d={cfg.d_model} L={cfg.layers} on Shakespeare, "
               f"{cfg.batch_size}x{cfg.seq_len} tokens/step, {seeds}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- main --------------------------------------------------------------------


def load_data(cfg: Config) -> dict[str, Any]:
  tok = shakespeare.ByteTokenizer()
  train = tok.encode(shakespeare.load_text("train"))
  valid = tok.encode(shakespeare.load_text("valid"))
  stream = shakespeare.batches(valid, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=12345)
  fixed = [next(stream) for _ in range(cfg.eval_batches)]
  return {"train": train, "valid": fixed}


def environment() -> dict[str, str]:
  dev = jax.devices()[0]
  return {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": getattr(dev, "device_kind", str(dev)),
          "devices": str(jax.device_count()),
          "python": platform.python_version()}


# --- merging earlier runs ----------------------------------------------------

# Config fields that do not change what a run computes; every other field
# must agree between the files that `merge_runs` combines.
# (``keep_wide`` only changes runs whose names say so: ``RECIPE+wide``.)
_NOT_TRAINING = ("recipes", "seeds", "prompt", "sample_tokens", "temperature",
                 "tolerance", "tolerances", "out", "json", "progress",
                 "merge", "mesh", "keep_wide", "calib_seed", "calib_steps",
                 "calib_batches", "baseline_run")


def merge_runs(cfg: Config) -> tuple[Config, dict[str, Any],
                                     dict[str, list[Run]], list[dict]]:
  """Runs from the ``cfg.merge`` JSON files, checked to be comparable.

  Returns the combined config (training settings from the files, recipes and
  seeds their union, the rest from ``cfg``), the model description, the runs
  per recipe (baseline first, seeds ascending) and one entry per file.
  Raises ValueError for an unreadable file, files trained with different
  settings, or a recipe seed whose baseline run is missing. A (recipe, seed)
  run found in several files keeps the first; if the numbers differ (the run
  is not reproducible on that machine) the entry says so and a line is
  printed.
  """
  fields = {f.name for f in dataclasses.fields(Config)}
  settings = model = first = None
  wide_seen: dict[str, list[tuple[tuple, str]]] = {}
  found: dict[tuple[str, int], tuple[Run, str]] = {}
  sources = []
  for path in cfg.merge:
    try:
      data = json.loads(pathlib.Path(path).read_text())
      file_cfg, file_model = dict(data["config"]), data["model"]
      file_runs = [Run(**r) for r in data["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"--merge: {path} is not a readable train_lm --json "
                       f"file ({type(e).__name__}: {e})") from None
    mine = {k: v for k, v in file_cfg.items() if k not in _NOT_TRAINING}
    unknown = sorted(set(mine) - fields)
    if unknown:
      raise ValueError(f"--merge: {path} has settings this script does not "
                       f"know: {unknown}")
    if settings is None:
      settings, model, first = mine, file_model, path
    diff = sorted(k for k in set(settings) | set(mine)
                  if settings.get(k) != mine.get(k))
    if diff or model != file_model:
      what = ", ".join(f"{k}: {mine.get(k)!r} here, {settings.get(k)!r} "
                       f"there" for k in diff) or "the model differs"
      raise ValueError(f"--merge: {path} was trained with other settings "
                       f"than {first} ({what}); only runs of the same "
                       "training settings can share a table.")
    # RECIPE+wide runs pool only where they kept the same layers wide: the
    # rules each file records per run name (a replay of measured rules
    # from their file keeps the same), else the same --keep-wide.
    rules = data.get("keep_wide_rules") or {}
    for name in sorted({r.recipe for r in file_runs
                        if r.recipe.endswith(WIDE)}):
      mine_wide = (rules.get(name), file_cfg.get("keep_wide"))
      for theirs, there in wide_seen.setdefault(name, []):  # every file
        if (theirs[0] == mine_wide[0] if theirs[0] is not None
            and mine_wide[0] is not None else theirs[1] == mine_wide[1]):
          continue
        raise ValueError(
            f"--merge: {path}'s {name} runs kept other layers wide than "
            f"{there}'s (--keep-wide {mine_wide[1]!r} here, "
            f"{theirs[1]!r} there, or other recorded rules); only runs "
            "keeping the same layers wide can share a table.")
      wide_seen[name].append((mine_wide, path))
    reproduced, differing = [], []
    for run in file_runs:
      key = (run.recipe, run.seed)
      if key not in found:
        found[key] = (run, path)
        continue
      kept, kept_path = found[key]
      same = (kept.val_loss == run.val_loss
              and kept.train_loss == run.train_loss)
      (reproduced if same else differing).append(list(key))
      if not same:
        print(f"--merge: {key[0]} seed {key[1]} differs between {kept_path} "
              f"(val {kept.final_val:.6f}, kept) and {path} "
              f"(val {run.final_val:.6f})")
    sources.append({"path": str(path), "environment": data.get("environment"),
                    "total_s": data.get("total_s"),
                    "keep_wide": file_cfg.get("keep_wide"),
                    "keep_wide_rules": data.get("keep_wide_rules"),
                    "runs": [[r.recipe, r.seed] for r in file_runs],
                    "reproduced": reproduced, "differing": differing})

  tuples = {k: tuple(v) if isinstance(v, list) else v
            for k, v in settings.items()}
  recipes = list(dict.fromkeys(r for r, _ in found))
  merged = dataclasses.replace(
      cfg, **tuples, recipes=tuple(recipes), baseline_run=True,
      seeds=tuple(sorted({s for _, s in found})))
  base_seeds = {s for r, s in found if r == merged.baseline}
  missing = sorted((r, s) for r, s in found if s not in base_seeds)
  if missing:
    raise ValueError(f"--merge: no {merged.baseline} run for "
                     + ", ".join(f"{r} seed {s}" for r, s in missing)
                     + "; each recipe seed is compared with the baseline run "
                     "of the same seed.")
  runs = {name: [found[k][0] for k in sorted(found) if k[0] == name]
          for name in merged.runs}
  return merged, model, runs, sources


# --- main --------------------------------------------------------------------


def train_all(cfg: Config):
  """Trains every recipe and seed; returns model description, runs, env."""
  env = environment()
  model_cfg = gpt_config(cfg)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(
      nnx.eval_shape(lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)))
  print(f"GPT d_model={cfg.d_model} layers={cfg.layers} heads={cfg.heads} "
        f"d_ff={model_cfg.d_ff} ({n_params / 1e6:.2f} M params), "
        f"{cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens, "
        f"dtype {cfg.dtype}, on {env['backend']} ({env['device']})"
        + (f", mesh {cfg.mesh}" if cfg.mesh else ""))
  data = load_data(cfg)
  tx = make_tx(cfg)
  runs: dict[str, list[Run]] = {}
  start = time.perf_counter()
  wide = wide_rules(cfg, data, tx)
  for seed_index, seed in enumerate(cfg.seeds):
    for name in cfg.runs:
      runs.setdefault(name, []).append(
          train_run(cfg, name, seed, data, tx, verbose=seed_index == 0,
                    rules=wide.get(name)))
  model = {**dataclasses.asdict(model_cfg), "dtype": cfg.dtype,
           "params": int(n_params)}
  return model, runs, env, time.perf_counter() - start, wide


def wide_rules(cfg: Config, data, tx) -> dict[str, tuple]:
  """The rules of each ``RECIPE+wide`` run: ``--keep-wide``'s regex or
  file, or (``auto``, ``noise``) measured on the baseline of
  ``calib_seed`` trained ``calib_steps`` steps (one device)."""
  names = [r for r in cfg.runs if r.endswith(WIDE)]
  if not names:
    return {}
  if not keep_wide.measured(cfg.keep_wide):
    rules = keep_wide.fixed_rules(cfg.keep_wide)
    return {name: rules for name in names}
  t0 = time.perf_counter()
  model, _ = build_model(cfg, cfg.baseline, cfg.calib_seed)
  stream = shakespeare.batches(data["train"], batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=cfg.calib_seed)
  batches = keep_wide.calibrate(model, qlayers.Optimizer(model, tx), stream,
                                cfg.calib_steps, cfg.calib_batches)
  out = {}
  for name in names:
    out[name] = keep_wide.measure(cfg.keep_wide, model, batches,
                                  name.removesuffix(WIDE))
    print(f"--keep-wide {cfg.keep_wide}: {name} keeps wide "
          f"{out[name][0].pattern!r}" if len(out[name]) > len(
              qlayers.convert.DEFAULT_RULES) else
          f"--keep-wide {cfg.keep_wide}: {name} keeps nothing more wide")
  print(f"measured in {time.perf_counter() - t0:.0f} s ({cfg.calib_steps} "
        f"{cfg.baseline} steps of seed {cfg.calib_seed}, "
        f"{cfg.calib_batches} batches)")
  return out


def main(argv=None) -> dict[str, Any]:
  """Runs everything; returns the numbers written by ``--json``."""
  cfg = parse_args(argv)
  out = pathlib.Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  extra: dict[str, Any] = {}
  if cfg.merge:
    cfg, model, runs, sources = merge_runs(cfg)
    env, total_s = sources[0]["environment"], sum(
        x["total_s"] or 0.0 for x in sources)
    extra["merged_from"] = sources
    print(f"merged {sum(map(len, runs.values()))} runs from "
          f"{len(sources)} files")
  else:
    model, runs, env, total_s, wide = train_all(cfg)
    if wide:
      extra["keep_wide_rules"] = {k: keep_wide.describe(v)
                                  for k, v in wide.items()}
      for name, rules in wide.items():
        keep_wide.save(rules, out / f"rules_{name}.json")

  if cfg.baseline not in runs:  # --no-baseline-run: numbers for --merge
    results = {"config": dataclasses.asdict(cfg), "model": model,
               "environment": env, "total_s": total_s,
               "runs": [dataclasses.asdict(r) for rs in runs.values()
                        for r in rs], **extra}
    for name, rs in runs.items():
      print(f"{name}: validation loss "
            + ", ".join(f"seed {r.seed} {r.final_val:.4f}" for r in rs))
    print(f"total {total_s:.0f} s; no {cfg.baseline} run: --merge this "
          "--json file with one that has it")
    cli.write_json(cfg.json, results)
    return results
  rows = summarize(cfg, runs)
  table = markdown_table(cfg, rows,
                         cpu_column=(env or {}).get("backend") == "cpu")
  print()
  print(table)
  print()
  for name, rs in runs.items():
    if rs[0].sample is not None:
      print(f"--- {name} (seed {rs[0].seed}, temperature "
            f"{cfg.temperature}) ---")
      print(rs[0].sample)
      print()
  png, md = out / "train_lm.png", out / "train_lm.md"
  plot(cfg, runs, png)
  md.write_text(table + "\n")
  print(f"total {total_s:.0f} s; wrote {png} and {md}")

  results = {
      "config": dataclasses.asdict(cfg),
      "model": model,
      "environment": env,
      "total_s": total_s,
      "rule": rule_text(cfg),
      "summary": rows,
      "runs": [dataclasses.asdict(r) for rs in runs.values() for r in rs],
      "png": str(png),
      **extra,
  }
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
