"""Makes ``examples/_common`` importable as ``_common`` for these tests.

(Strict dtype promotion, rank-promotion errors and warnings-as-errors come
from ``tests/conftest.py``; the example models must pass under them too.)
"""

import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
  sys.path.insert(0, str(EXAMPLES))
