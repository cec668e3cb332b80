"""Swap a pretrained BERT's dense layers for FP8 ones in one call; fine-tune it.

  python examples/replace_dense.py                    # fp8_current, CPU
  python examples/replace_dense.py --recipe mxfp8 --steps 200

1. Loads all-MiniLM-L6-v2 into the NNX BERT of ``_common/bert.py`` and checks
   its sentence embeddings behave as the reference model's do: paraphrases
   close, unrelated sentences far (a cosine table).
2. ``qlayers.quantize(model, recipe)`` swaps every ``nnx.Linear`` for a
   ``qlayers.QuantDense`` that reuses its Params; the report is printed.
3. Compares the embeddings under FP8 forward GEMMs with the FP32 ones
   (cosine per sentence; expected > 0.99).
4. Puts a classification head on the converted encoder and fine-tunes it
   briefly on comedy-vs-tragedy speeches (``_common/tasks.py``), trained with
   ``qlayers.value_and_grad`` and ``qlayers.Optimizer``; reports validation
   accuracy before and after.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import qlayers
from _common import bert, cli, tasks, training

SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone is playing a drum kit.",
)
"""Three paraphrase pairs: rows ``2i`` and ``2i + 1`` mean the same thing."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    recipe: the qlayers recipe for every linear layer of the encoder.
    min_cosine: smallest acceptable cosine between FP32 and quantized
      embeddings of the same sentence.
    steps, batch_size, lr, warmup, weight_decay: fine-tuning (AdamW, linear
      warmup then cosine decay to 10%).
    max_words, max_len: speeches cut to ``max_words`` words, padded or cut
      to ``max_len`` word pieces.
    eval_examples: validation speeches scored (0: all).
    layers: keep only the first N encoder layers (0: all 6); for quick
      tests of the plumbing, not for meaningful numbers.
    seed: head init, data order.
    json: also write all numbers to this file.
    progress: show a progress bar.
  """

  recipe: str = "fp8_current"
  min_cosine: float = 0.99
  steps: int = 60
  batch_size: int = 32
  lr: float = 1e-4
  warmup: int = 6
  weight_decay: float = 0.01
  max_words: int = 32
  max_len: int = 64
  eval_examples: int = 512
  layers: int = 0
  seed: int = 0
  json: str | None = None
  progress: bool = True


def parse_args(argv=None) -> Config:
  """Command-line flags -> `Config` (defaults from the dataclass)."""
  return cli.parse(Config, __doc__, argv,
                   at_least={"steps": 1, "batch_size": 1, "warmup": 0,
                             "max_words": 1, "max_len": 3, "eval_examples": 0,
                             "layers": 0},
                   recipe={"help": "available: " + cli.recipes()})


# --- embeddings --------------------------------------------------------------


def cosine_table(emb: np.ndarray, labels) -> str:
  """Pairwise cosines of L2-normalised rows, as aligned text."""
  sims = emb @ emb.T
  head = "      " + " ".join(f"{i:>6d}" for i in range(len(labels)))
  rows = [head] + [f"{i:>4d}  " + " ".join(f"{s:+6.3f}" for s in row)
                   + f"   {labels[i]}" for i, row in enumerate(sims)]
  return "\n".join(rows)


def paraphrases_closest(emb: np.ndarray) -> bool:
  """Each sentence's nearest other sentence is its paraphrase partner."""
  sims = emb @ emb.T
  np.fill_diagonal(sims, -np.inf)
  return all(int(np.argmax(sims[i])) == i ^ 1 for i in range(len(emb)))


# --- classification ----------------------------------------------------------


@nnx.jit
def train_step(model, optimizer, batch, labels):
  """One AdamW step on cross-entropy; returns the batch loss."""
  def loss_fn(model):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
  loss, grads = qlayers.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@functools.partial(jax.jit, static_argnames="graphdef")
def _predict(graphdef, state, input_ids, attention_mask):
  return jnp.argmax(nnx.merge(graphdef, state)(input_ids, attention_mask), -1)


def accuracy(model, data: dict[str, np.ndarray], labels, batch_size) -> float:
  """Fraction of ``labels`` predicted, without touching the model's state."""
  graphdef, state = nnx.split(model)
  correct = 0
  for i in range(0, len(labels), batch_size):
    pred = _predict(graphdef, state, data["input_ids"][i:i + batch_size],
                    data["attention_mask"][i:i + batch_size])
    correct += int(np.sum(np.asarray(pred) == labels[i:i + batch_size]))
  return correct / len(labels)


def make_tx(cfg: Config) -> optax.GradientTransformation:
  return training.adamw_cosine(
      lr=cfg.lr, steps=cfg.steps, warmup=cfg.warmup,
      weight_decay=cfg.weight_decay, b2=0.999, decay_matrices_only=False)


# --- main --------------------------------------------------------------------


def main(argv=None) -> dict[str, Any]:
  """Runs everything; returns the numbers written by ``--json``."""
  cfg = parse_args(argv)
  results: dict[str, Any] = {"config": dataclasses.asdict(cfg),
                             "backend": jax.default_backend()}
  start = time.perf_counter()

  # 1. The pretrained encoder behaves like the reference model.
  encoder, tokenizer, _ = bert.load_minilm()
  if cfg.layers:
    encoder.layers = nnx.List(list(encoder.layers)[:cfg.layers])
  sentences = list(SENTENCES)
  emb_fp32 = bert.sentence_embeddings(encoder, tokenizer, sentences)
  print("all-MiniLM-L6-v2, FP32: cosine similarities (rows 2i, 2i+1 are "
        "paraphrases)")
  print(cosine_table(emb_fp32, sentences))
  results["paraphrases_closest_fp32"] = paraphrases_closest(emb_fp32)
  print(f"each sentence closest to its paraphrase: "
        f"{results['paraphrases_closest_fp32']}")

  # 2. One call swaps every nnx.Linear.
  report = qlayers.quantize(encoder, cfg.recipe)
  print(report)
  results["converted"] = len(report.converted)

  # 3. Embeddings under quantized GEMMs.
  emb_q = bert.sentence_embeddings(encoder, tokenizer, sentences)
  per_sentence = np.sum(emb_fp32 * emb_q, axis=-1)
  results["cosine_fp32_vs_quantized"] = per_sentence.tolist()
  results["paraphrases_closest_quantized"] = paraphrases_closest(emb_q)
  print(f"\n{cfg.recipe}: cosine similarities")
  print(cosine_table(emb_q, sentences))
  print(f"\ncosine(FP32, {cfg.recipe}) per sentence:")
  for s, c in zip(sentences, per_sentence):
    print(f"  {c:.5f}  {s}")
  ok = bool(np.min(per_sentence) > cfg.min_cosine)
  results["embeddings_close"] = ok
  print(f"min {np.min(per_sentence):.5f} > {cfg.min_cosine}: {ok}")
  if not ok:
    raise RuntimeError(f"quantized embeddings drifted: min cosine "
                       f"{np.min(per_sentence):.5f} <= {cfg.min_cosine}")

  # 4. Fine-tune a classifier on the converted encoder.
  train, valid = tasks.genre_task(max_words=cfg.max_words, seed=cfg.seed)
  n_eval = cfg.eval_examples or len(valid)
  valid_data = bert.tokenize(tokenizer, valid.texts[:n_eval],
                             max_len=cfg.max_len)
  valid_labels = valid.labels[:n_eval]
  model = bert.BertClassifier(encoder, len(train.label_names),
                              rngs=nnx.Rngs(cfg.seed))
  optimizer = qlayers.Optimizer(model, make_tx(cfg))
  acc_before = accuracy(model, valid_data, valid_labels, 64)
  print(f"\ngenre task: {len(train)} training speeches, {len(valid_labels)} "
        f"validation speeches (other plays); accuracy before fine-tuning "
        f"(untrained head): {acc_before:.3f}")
  rng = np.random.default_rng(cfg.seed)
  losses, step_times = [], []
  bar = training.progress(cfg.steps, f"fine-tune ({cfg.recipe})",
                          enabled=cfg.progress)
  for step in bar:
    idx = rng.choice(len(train), size=cfg.batch_size, replace=False)
    batch = bert.tokenize(tokenizer, [train.texts[i] for i in idx],
                          max_len=cfg.max_len)
    batch = {k: batch[k] for k in ("input_ids", "attention_mask")}
    t0 = time.perf_counter()
    loss = float(train_step(model, optimizer, batch, train.labels[idx]))
    if step > 1:
      step_times.append(time.perf_counter() - t0)
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
  bar.close()
  acc_after = accuracy(model, valid_data, valid_labels, 64)
  results.update(accuracy_before=acc_before, accuracy_after=acc_after,
                 train_loss=losses,
                 step_ms=1e3 * float(np.mean(step_times)) if step_times
                 else None)
  print(f"accuracy after {cfg.steps} steps: {acc_after:.3f} (train loss "
        f"{np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f})")
  results["seconds"] = round(time.perf_counter() - start, 1)
  print(f"total {results['seconds']} s")
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
