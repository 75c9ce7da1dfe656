"""Arithmetic on measured numbers: intervals, paired differences, separability."""
