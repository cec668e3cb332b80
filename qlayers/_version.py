"""The package's version, one place for `qlayers.__version__` and what a
checkpoint records (`qlayers.checkpoint`); pyproject.toml states it too."""

__version__ = "0.4.0"
