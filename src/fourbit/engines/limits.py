"""What an engine cannot do with a given model, known from its config.json alone (so the
workflow checks it before any job, and the engine refuses it the same way at run time)."""

from __future__ import annotations


def prompt_exceeds_positions(model_config: dict, prompt_tokens: int) -> str | None:
    """vLLM refuses a prompt longer than the model's positions (llama-bench runs past them)."""
    positions = model_config.get("max_position_embeddings")
    if positions is not None and prompt_tokens > positions:
        return (f"not benchmarked: its {prompt_tokens}-token prompt (pp{prompt_tokens}) exceeds "
                f"the model's {positions} positions, which vLLM refuses")
    return None
