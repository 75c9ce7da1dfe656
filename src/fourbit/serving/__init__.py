"""Serving: each arm on its engine's real OpenAI-compatible server, driven by one load generator.

    process    start a server in its own process group on a loopback port, wait until it
               answers, stop the whole group (SIGTERM, then SIGKILL) on success and failure
    vllm       vLLM's OpenAI server on a checkpoint (serve_command)
    llamacpp   llama-server on a GGUF (serve_command)
    workload   the prompts: token ids from the study's evaluation windows
    load       one concurrency level timed by vLLM's own serving benchmark

fourbit.steps.serve puts them together for the study.
"""
