"""Offline corpora for the reference runs (prepared once into cached token files)."""

from .shakespeare import prepare

__all__ = ["prepare"]
