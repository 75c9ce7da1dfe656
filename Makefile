# The two commands of the README: `make report` and `make test`.
# Both create or reuse the project-local virtual environment .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= $(shell nproc)
# setup.py and the kernel source too: a change to either must rebuild the C++ extension.
ENV_FILES := envs/requirements.txt envs/vllm-deps.txt envs/fourbit.post-deploy.sh pyproject.toml \
	setup.py src/fourbit/kernels/csrc/int4_cpu.cpp src/fourbit/kernels/csrc/multirow.inc
STAMP := $(VENV)/.installed-$(shell cat $(ENV_FILES) | sha256sum | cut -c1-16)

.PHONY: venv llamacpp setup report test dry-run architectures disk-check
venv: $(STAMP)

# A new venv takes about 4 GB (torch, vLLM and what they need), and `make test` about 2 GB
# more (llama.cpp's build, the tests' folders, compile caches): refused up front with the
# free space, not by pip's "No space left on device" halfway through an install.
SETUP_NEED_GB ?= 6
disk-check:
	@free_kb=$$(df -Pk . | awk 'NR == 2 {print $$4}'); \
	if [ "$$free_kb" -lt $$(( $(SETUP_NEED_GB) * 1048576 )) ]; then \
	  echo "make: setting up needs $(SETUP_NEED_GB) GB free on the filesystem of $(CURDIR) (the venv about 4 GB, the tests about 2 GB); $$(( free_kb / 1048576 )) GB are free there" >&2; \
	  exit 1; \
	fi

# llama.cpp's tools, built once per machine from the llama-cpp-python sdist and
# cached outside the work tree (~/.cache/fourbit/llama.cpp); a no-op when cached.
# The build needs only the standard library (PYTHONPATH=src, no venv), so `report` and
# `test` run it beside the venv's install, which leaves a core mostly idle (pip
# downloading and unpacking); the workflow's build_llamacpp job then finds it cached.
llamacpp:
	PYTHONPATH=src $(PYTHON) -m fourbit.llamacpp.build --jobs $(CORES)

# Both, side by side.
setup:
	$(MAKE) --no-print-directory -j2 venv llamacpp

$(STAMP): $(ENV_FILES)
	test -x $(BIN)/python || { $(MAKE) --no-print-directory disk-check && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r envs/requirements.txt -r envs/vllm-deps.txt
	PATH=$(abspath $(BIN)):$$PATH envs/fourbit.post-deploy.sh
	rm -f $(VENV)/.installed-* && touch $@

# The workflow starts as soon as the venv is ready, with llama.cpp's build still going
# beside it: its first job, the builtin model's training, needs only the venv and runs
# meanwhile on the cores the build leaves idle (linking, waiting on pip). The workflow's
# build_llamacpp job waits on the build's lock, or finds it done; if this build fails,
# that job builds again and reports why.
report:
	$(MAKE) --no-print-directory llamacpp & build=$$!; \
	$(MAKE) --no-print-directory venv && $(BIN)/snakemake --cores $(CORES) results/report.md; \
	status=$$?; wait $$build; exit $$status

test: setup
	$(BIN)/python -m pytest

dry-run: venv
	$(BIN)/snakemake --cores $(CORES) -n results/report.md

# The real-architecture tier (configs/architectures/): every method on random weights at
# the shapes of four model families, each end to end or its arms refused before any job;
# one report per family in results/architectures/<family>/.
ARCHITECTURES := llama-3.2-1b qwen2.5-0.5b smollm-135m smollm-360m
architectures: venv
	for family in $(ARCHITECTURES); do \
	  $(BIN)/snakemake --cores $(CORES) --configfile configs/architectures/common.yaml \
	    configs/architectures/$$family.yaml -- results/architectures/$$family/report.md || exit 1; \
	done
