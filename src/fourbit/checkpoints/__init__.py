"""Checkpoints on disk: Hugging Face safetensors folders (hf) and fourbit's
quantized ones (quantized), read and written without a model class's help."""
