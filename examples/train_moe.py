"""Train the MoE GPT on Shakespeare under FP8/MX recipes and BF16, side by side.

  python examples/train_moe.py                        # BF16 vs fp8_current
  python examples/train_moe.py --recipes fp8_current,fp8_delayed,deepseek_v3,mxfp8 \\
      --seeds 0,1,2 --json out/train_moe.json         # parity over seeds
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python examples/train_moe.py --expert-parallel 8 --transport
                                                      # experts over 8 devices
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python examples/train_moe.py --expert-parallel 4 --fsdp 2
                                          # experts over 4, kernels over 2 more

The model is ``_common/moe.py``'s: the example GPT with every MLP an MoE
layer (``--experts`` experts, top ``--top-k``, sorted dispatch with
``ragged_dot``, Switch load-balancing loss weighted ``--aux-weight``). Every
run starts from the same weights for a seed and sees the same batches.
The baseline keeps its layers and computes them in BF16; each recipe run
first calls ``qlayers.quantize(model, recipe)``, which converts the
attention projections and the experts' grouped GEMMs (one amax history per
expert under delayed scaling) and keeps the router and the head wide.

``--expert-parallel D`` shards the experts over a mesh axis ``expert`` of
``D`` devices (the batch is split over it too): tokens reach their experts
with ``all_to_all`` inside ``shard_map`` (`qlayers.expert_parallel`);
``--transport`` sends them as the recipe's 1-byte payloads plus scales.
``--fsdp F`` adds a mesh axis ``fsdp`` of ``F`` devices (the batch split
over both): each expert kernel is also split over it along K, and each
quantized grouped GEMM gathers its shard as payload + scales (FSDP).

Prints the final validation loss of each run and its gap to the baseline of
the same seed; ``--json`` writes every number. ``--qwen3-steps N`` also
converts a third-party NNX MoE, Tunix's Qwen3-MoE at a tiny size
(``_common/moe_qwen3.py``; needs ``examples/requirements-tunix.txt``), with
each recipe and trains it N steps, printing the conversion report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import qlayers
from _common import cli, moe, shakespeare, training


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag)."""

  recipes: tuple[str, ...] = ("fp8_current",)
  seeds: tuple[int, ...] = (0,)
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 64
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  d_ff: int = 256
  experts: int = 8
  top_k: int = 2
  aux_weight: float = 0.01
  lr: float = 3e-3
  warmup: int = 30
  eval_batches: int = 8
  expert_parallel: int = 1
  fsdp: int = 1
  transport: bool = False
  qwen3_steps: int = 0
  json: str | None = None


def _model(cfg: Config, recipe: str | None, seed: int) -> moe.MoEGPT:
  config = moe.MoEConfig(
      vocab_size=shakespeare.ByteTokenizer.vocab_size, max_len=cfg.seq_len,
      d_model=cfg.d_model, n_layers=cfg.layers, n_heads=cfg.heads,
      d_ff=cfg.d_ff, n_experts=cfg.experts, top_k=cfg.top_k,
      aux_weight=cfg.aux_weight, dtype=jnp.bfloat16,
      transport=recipe if cfg.transport else None)
  model = moe.MoEGPT(config, rngs=nnx.Rngs(seed))
  if recipe is not None:
    # The first line counts converted, kept wide and skipped layers (e.g.
    # deepseek_v3 skips GEMMs smaller than its 128-element tiles).
    print(str(qlayers.quantize(model, recipe)).splitlines()[0])
  return model


@nnx.jit
def _train_step(model, optimizer, inputs, targets):
  (loss, ce), grads = qlayers.value_and_grad(moe.loss_fn, has_aux=True)(
      model, inputs, targets)
  optimizer.update(model, grads)
  return loss, ce


@nnx.jit
def _eval_loss(model, inputs, targets):
  return moe.loss_fn(model, inputs, targets)[1]


def train(cfg: Config, recipe: str | None, seed: int, train_tokens,
          valid) -> dict:
  """One run; its per-step training cross-entropy and final validation."""
  model = _model(cfg, recipe, seed)
  tx = training.adamw_cosine(lr=cfg.lr, steps=cfg.steps, warmup=cfg.warmup,
                             weight_decay=0.1)
  optimizer = qlayers.Optimizer(model, tx)
  stream = shakespeare.batches(train_tokens, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=seed)
  losses, start = [], time.perf_counter()
  for _ in training.progress(cfg.steps, recipe or "bf16"):
    inputs, targets = next(stream)
    _, ce = _train_step(model, optimizer, jnp.asarray(inputs),
                        jnp.asarray(targets))
    losses.append(float(ce))
  model.eval()
  val = float(np.mean([_eval_loss(model, jnp.asarray(i), jnp.asarray(t))
                       for i, t in valid]))
  return {"recipe": recipe or "bf16", "seed": seed, "train_ce": losses,
          "valid_ce": val, "seconds": time.perf_counter() - start}


def parse(argv=None) -> Config:
  """Command-line flags -> `Config`; stops on flags that cannot work."""
  p = cli.parser(Config, __doc__)
  args = vars(p.parse_args(argv))
  cli.check(p, args, at_least={
      "steps": 1, "batch_size": 1, "expert_parallel": 1, "fsdp": 1})
  ep, fsdp = args["expert_parallel"], args["fsdp"]
  if fsdp > 1 and ep == 1:  # the fsdp axis exists only beside the expert one
    p.error(f"--fsdp {fsdp} needs --expert-parallel > 1")
  if ep * fsdp > jax.device_count():
    p.error(f"--expert-parallel {ep} --fsdp {fsdp} needs {ep * fsdp} devices, "
            f"this host has {jax.device_count()} (on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={ep * fsdp})")
  if args["experts"] % ep:
    p.error(f"--experts {args['experts']} do not split over "
            f"--expert-parallel {ep}")
  # BF16 is the baseline, run for every seed: a "bf16" recipe run would
  # replace it under the same name.
  args["recipes"] = tuple(r for r in args["recipes"] if r != "bf16")
  return Config(**args)


def main(argv=None) -> dict:
  cfg = parse(argv)
  tok = shakespeare.ByteTokenizer()
  train_tokens = tok.encode(shakespeare.load_text("train"))
  valid_stream = shakespeare.batches(
      tok.encode(shakespeare.load_text("valid")), batch_size=cfg.batch_size,
      seq_len=cfg.seq_len, seed=1234)
  valid = [next(valid_stream) for _ in range(cfg.eval_batches)]
  mesh = None
  if cfg.expert_parallel > 1:
    mesh = jax.make_mesh((cfg.fsdp, cfg.expert_parallel), ("fsdp", "expert"),
                         axis_types=(AxisType.Auto,) * 2)
  runs = []
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for seed in cfg.seeds:
      for recipe in (None, *cfg.recipes):
        runs.append(train(cfg, recipe, seed, train_tokens, valid))
  base = {r["seed"]: r["valid_ce"] for r in runs if r["recipe"] == "bf16"}
  print(f"\n{'recipe':<14}{'seed':>5}{'valid CE':>10}{'vs bf16':>9}"
        f"{'s/run':>8}")
  for r in runs:
    r["gap"] = r["valid_ce"] / base[r["seed"]] - 1
    print(f"{r['recipe']:<14}{r['seed']:>5}{r['valid_ce']:>10.4f}"
          f"{100 * r['gap']:>8.2f}%{r['seconds']:>8.1f}")
  results = {"config": dataclasses.asdict(cfg), "runs": runs}
  if cfg.qwen3_steps:  # a third-party NNX MoE: Tunix's Qwen3-MoE
    from _common import moe_qwen3  # pylint: disable=g-import-not-at-top
    results["qwen3"] = {}
    for recipe in cfg.recipes:
      losses, report = moe_qwen3.train(recipe, steps=cfg.qwen3_steps)
      print(f"\nTunix Qwen3-MoE (tiny), {recipe}: losses "
            f"{[round(x, 4) for x in losses]}\n{report}")
      results["qwen3"][recipe] = {"losses": losses, "report": str(report)}
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main()
