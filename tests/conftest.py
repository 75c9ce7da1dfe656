"""Shared fixtures: tiny real Hugging Face models written to disk."""

from __future__ import annotations

import pytest
import torch


def save_tiny_llama(folder, *, tied: bool, hidden: int = 256, intermediate: int = 512, layers: int = 2,
                    vocab: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture
def tiny_tied(tmp_path):
    folder = tmp_path / "tied"
    save_tiny_llama(folder, tied=True)
    return folder


@pytest.fixture
def tiny_untied(tmp_path):
    folder = tmp_path / "untied-source"
    save_tiny_llama(folder, tied=False)
    return folder
