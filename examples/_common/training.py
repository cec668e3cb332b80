"""The optimizer and progress bar of the example training loops."""

from __future__ import annotations

import jax
import optax


def _matrices(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def adamw_cosine(
    *, lr: float, steps: int, warmup: int, weight_decay: float,
    min_lr_ratio: float = 0.1, clip: float = 1.0, b2: float = 0.95,
    decay_matrices_only: bool = True,
) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW under warmup and cosine decay.

  Args:
    lr: peak learning rate, reached linearly over the first ``warmup`` steps.
    steps: total steps; the cosine decays to ``lr * min_lr_ratio`` by then.
    warmup: linear-warmup steps from 0.
    weight_decay: decoupled weight decay.
    min_lr_ratio: final learning rate as a fraction of ``lr``.
    clip: global gradient-norm limit.
    b2: AdamW second-moment decay (``b1`` is 0.9).
    decay_matrices_only: decay only parameters with two or more dimensions
      (not biases and norm scales); otherwise all of them.

  Returns:
    The optax transformation for ``qlayers.Optimizer``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=lr * min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(clip),
      optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=weight_decay,
                  mask=_matrices if decay_matrices_only else None))


def progress(steps: int, desc: str, *, enabled: bool = True):
  """A progress bar over the steps ``1 .. steps`` (tqdm, imported here: the
  optimizer alone, as ``benchmarks/compile.py`` builds it, needs none)."""
  from tqdm.auto import tqdm
  return tqdm(range(1, steps + 1), desc=desc, disable=not enabled,
              dynamic_ncols=True)
