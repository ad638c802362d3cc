"""Acceptance reports (BF16 vs NVFP4 runs)."""

from .compare import CompareError, Report, compare, write

__all__ = ["CompareError", "Report", "compare", "write"]
