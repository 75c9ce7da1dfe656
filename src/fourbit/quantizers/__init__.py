"""Quantizing a whole model: methods, the layer walk, the plan; above the checkpoints it reads."""
