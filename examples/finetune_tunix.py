"""Train a Tunix Qwen3 model with FP8 GEMMs using Tunix's own trainer.

  pip install --no-deps -r examples/requirements-tunix.txt   # or qlayers[tunix]
  python examples/finetune_tunix.py                 # ~minutes on CPU
  python examples/finetune_tunix.py --recipes fp8_delayed --sft-steps 300

For each recipe (``bf16``, qlayers' unquantized recipe, is the baseline;
every run starts from the same weights and sees the same data):

1. Builds a small Qwen3 from Tunix (``tunix.models.qwen3``; byte vocabulary,
   random initial weights: no Qwen3 checkpoint can be downloaded here).
2. Converts it with ``qlayers.integrations.tunix.quantize``: the attention
   projections (Tunix's own ``Einsum``) and the MLPs (``nnx.Linear``) run
   their GEMMs in the recipe; ``lm_head`` and the embedding stay wide.
3. Full-weight SFT with Tunix's ``PeftTrainer`` (as
   ``qlayers.integrations.tunix.PeftTrainer``: Tunix's trainer, whose step
   also ends each delayed-scaling step) on the Shakespeare training plays.
4. LoRA: rank-``lora_rank`` adapters (``nnx.LoRAParam``) on the attention
   projections; the same trainer then trains only them (Tunix's PEFT mode)
   and the base weights stay as they were, which the script checks.
5. Reports the training loss at the start and end of each phase and the
   validation loss after each, and (``--json``) writes them.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from _common import cli, shakespeare

try:
  from tunix.models.qwen3 import model as qwen3
  from tunix.sft import peft_trainer, utils
except ImportError as e:  # the extra is not installed
  raise SystemExit("This example needs Tunix: pip install --no-deps -r "
                   "examples/requirements-tunix.txt (or 'qlayers[tunix]')"
                   ) from e

from qlayers.integrations import tunix as qtunix


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    recipes: qlayers recipes to train with (``bf16``: the baseline, BF16
      GEMM inputs, nothing quantized).
    layers, d_model, hidden, heads, kv_heads: the Qwen3 shape (head_dim =
      d_model / heads).
    sft_steps, lora_steps: steps of the two phases.
    batch_size, seq_len: batch shape (tokens are bytes).
    sft_lr, lora_lr: Adam learning rates of the two phases.
    lora_rank: rank of the attention adapters.
    eval_batches: validation batches scored after each phase.
    seed: initial weights and data order.
    json: write the results here.
  """

  recipes: tuple[str, ...] = ("bf16", "fp8_current", "fp8_delayed")
  layers: int = 2
  d_model: int = 128
  hidden: int = 384
  heads: int = 4
  kv_heads: int = 2
  sft_steps: int = 150
  lora_steps: int = 50
  batch_size: int = 8
  seq_len: int = 128
  sft_lr: float = 3e-3
  lora_lr: float = 3e-3
  lora_rank: int = 8
  eval_batches: int = 4
  seed: int = 0
  json: str | None = None


def build_model(cfg: Config) -> nnx.Module:
  """A Qwen3 of ``cfg``'s shape with random weights (Tunix zero-initialises
  the MLP kernels, which checkpoints overwrite: they get LeCun normal)."""
  config = qwen3.ModelConfig(
      num_layers=cfg.layers, vocab_size=shakespeare.ByteTokenizer.vocab_size,
      embed_dim=cfg.d_model, hidden_dim=cfg.hidden, num_heads=cfg.heads,
      head_dim=cfg.d_model // cfg.heads, num_kv_heads=cfg.kv_heads,
      rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=False)
  model = qwen3.Qwen3(config, rngs=nnx.Rngs(cfg.seed))
  key = jax.random.key(cfg.seed + 1)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, nnx.Linear):
      key, sub = jax.random.split(key)
      m.kernel.set_value(jax.random.normal(sub, m.kernel.shape)
                         * m.in_features ** -0.5)
  return model


def data(cfg: Config, split: str, n: int, seed: int) -> list[dict[str, Any]]:
  """``n`` batches of byte windows ``[batch, seq_len + 1]`` (Tunix's loss
  predicts token t+1 from the tokens up to t)."""
  tokens = shakespeare.ByteTokenizer().encode(shakespeare.load_text(split))
  it = shakespeare.batches(tokens, batch_size=cfg.batch_size,
                           seq_len=cfg.seq_len, seed=seed)
  out = []
  for _ in range(n):
    x, y = next(it)
    out.append({"input_tokens": np.concatenate([x, y[:, -1:]], axis=1)})
  return out


def model_inputs(batch: dict[str, Any]) -> dict[str, jax.Array]:
  """Tunix's loss arguments from a batch of tokens (no padding)."""
  mask = jnp.ones(batch["input_tokens"].shape, jnp.bool_)
  return dict(input_tokens=jnp.asarray(batch["input_tokens"]),
              input_mask=mask,
              positions=utils.build_positions_from_mask(mask),
              attention_mask=utils.make_causal_attn_mask(mask))


def phase(model, lr: float, train, valid) -> dict[str, Any]:
  """One run of Tunix's trainer (LoRA if the model has LoRAParams)."""
  trainer = qtunix.PeftTrainer(
      model, optax.adam(lr), peft_trainer.TrainingConfig(
          eval_every_n_steps=len(train), max_steps=len(train),
          pbar_description=None))
  trainer = trainer.with_gen_model_input_fn(model_inputs)
  t0 = time.perf_counter()
  trainer.train(train, valid)
  jax.effects_barrier()
  seconds = time.perf_counter() - t0
  log = trainer.metrics_logger
  train_loss = [float(x) for x in log.get_metric_history("", "loss", "train")]
  val_loss = [float(x) for x in log.get_metric_history("", "loss", "eval")]
  return {"lora": trainer._lora_enabled,  # pylint: disable=protected-access
          "steps": len(train_loss), "first_loss": train_loss[0],
          "last_loss": float(np.mean(train_loss[-5:])),
          "val_loss": val_loss[-1], "seconds": seconds}


def run(cfg: Config, recipe: str, sft, lora, valid) -> dict[str, Any]:
  """Both phases for one recipe."""
  model = build_model(cfg)
  print(qtunix.quantize(model, recipe))
  out = {"recipe": recipe, "sft": phase(model, cfg.sft_lr, sft, valid)}
  base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  before = nnx.clone(nnx.state(model, base))
  n = qtunix.add_lora(model, cfg.lora_rank, rngs=nnx.Rngs(cfg.seed + 2))
  out["lora"] = phase(model, cfg.lora_lr, lora, valid)
  out["lora"]["adapted_layers"] = n
  out["lora"]["base_unchanged"] = all(jax.tree.leaves(jax.tree.map(
      lambda a, b: bool(np.array_equal(a, b)), nnx.state(model, base),
      before)))
  for k in ("sft", "lora"):
    r = out[k]
    print(f"{recipe:>12} {k:>4}: loss {r['first_loss']:.3f} -> "
          f"{r['last_loss']:.3f}, validation {r['val_loss']:.3f} "
          f"({r['steps']} steps, {r['seconds']:.0f} s)")
  return out


def main(argv=None) -> dict[str, Any]:
  """Runs everything; returns the numbers written by ``--json``."""
  cfg = cli.parse(Config, __doc__, argv, at_least={
      "sft_steps": 1, "lora_steps": 1, "batch_size": 1, "seq_len": 2,
      "eval_batches": 1, "lora_rank": 1})
  sft = data(cfg, "train", cfg.sft_steps, cfg.seed)
  lora = data(cfg, "train", cfg.lora_steps, cfg.seed + 1)
  valid = data(cfg, "valid", cfg.eval_batches, cfg.seed + 3)
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion(
      "standard"):  # Tunix's models broadcast by rank
    runs = [run(cfg, r, sft, lora, valid) for r in cfg.recipes]
  results = {"config": dataclasses.asdict(cfg), "runs": runs}
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
