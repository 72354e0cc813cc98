"""The error measures under their old import path, for test modules not yet switched to
pagedfuse.numerics (the one source of measures and tolerances)."""

from pagedfuse.numerics import max_rel_err, rel_err

__all__ = ["max_rel_err", "rel_err"]
