"""fourbit: which 4-bit CPU build of a causal LM to ship, measured end to end."""

__version__ = "0.1.0"
