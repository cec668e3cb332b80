"""Shared test support: reference implementations, model helpers, and the
multi-device / multi-process case scripts the tests run in subprocesses."""
