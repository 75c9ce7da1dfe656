"""Serving: each arm on its engine's real OpenAI-compatible server, driven by one load generator.

    process    start a server in its own process group on a loopback port, wait until it
               answers, stop the whole group (SIGTERM, then SIGKILL) on success and failure
    vllm_server      vLLM's OpenAI server on a checkpoint (serve_command)
    llamacpp_server  llama-server on a GGUF (serve_command)
    registry         which server runs each engine's arms
    workload         the prompts: token ids from the study's evaluation windows
    load             one concurrency level, timed by the one client both servers get

fourbit.steps.serve puts them together for the study.
"""
