# The two commands: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-dagger demo-core demo-train demo-train-trl test test-sglang lint bench clean tiny-model check-tiny-model

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: 2.13.0 is a local CPU wheel here, so nothing pulls a multi-GB CUDA build.
# pip's "Location ... is ignored" notes about this machine's extra indexes are filtered out.
# --no-compile: pip would byte-compile every file of torch, ray and transformers up front (over a minute
# on 2 cores); Python compiles the modules a run imports, once, as it imports them.
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing torch 2.13.0 (CPU), then rayapp with Ray, transformers, the test tools and matplotlib ..."
	$(PIP_INSTALL) torch==2.13.0 2>&1 | grep -v 'is ignored: it is neither' || true
	$(PIP_INSTALL) -e '.[hf,test,plot]' 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/python -c 'import rayapp, ray, torch, transformers, matplotlib' && touch $(STAMP)
	@echo "installed into $(VENV)"

demo: $(STAMP)
	$(BIN)/rayapp demo

# Three DAgger iterations (rollout k, eval k) on the embedded default; artifacts in /tmp/rayapp-dagger-local.
demo-dagger: $(STAMP)
	$(BIN)/rayapp demo --recipe recipes/dagger_local/rollout.yaml --rollouts 3

# GRPO through the Serve app on CPU (about 10 minutes): held-out accuracy and a plot in /tmp/rayapp-train.
# matplotlib comes with the 'plot' extra (installed with the rest); without it the run skips the plot and says so.
demo-train: $(STAMP)
	$(BIN)/python recipes/train_grpo.py

# The same GRPO run with TRL's GRPOTrainer as the trainer (rayapp.trainers.trl, docs/trainers.md): history in
# /tmp/rayapp-train-trl, and a plot of both trainers' curves there when `make demo-train` ran before it.
demo-train-trl: $(VENV)/.trl
	$(BIN)/python recipes/train_grpo_trl.py

demo-core: $(STAMP)
	$(BIN)/python -m rayapp.demo

lint: $(STAMP)
	$(BIN)/ruff check rayapp tests bench recipes

# The main run over 4 pytest-xdist workers (whole files per worker; the files on the session's local Ray all on one
# worker: tests/conftest.py): most of it waits on subprocesses, sockets and timeouts, and alone it kept half a core
# busy. Then tests/isolated in a second pytest process (its own Ray head for the Serve apps); beside the main run it
# gained nothing on 2 cores (it is CPU-bound) and made timing-sensitive tests fail. docs/testing.md has the figures.
# The SGLang lane is `make test-sglang`.
test: lint $(VENV)/.test-extras
	$(BIN)/python -m pytest --ignore=tests/isolated --ignore=tests/sglang_engine -n 4 --dist loadgroup
	$(BIN)/python -m pytest tests/isolated

# What only the tests need, out of $(STAMP) so that `make demo` installs none of it: the 'gym' extra (SkyRL-gym,
# tests/test_agent_gym.py), 'trl' (TRL's GRPOTrainer, tests/test_trainer_trl*.py, tests/isolated/test_trl_serve.py)
# and 'agents-sdk' (the OpenAI Agents SDK, tests/test_gateway_agents_sdk.py)
$(VENV)/.test-extras: pyproject.toml | $(STAMP)
	$(PIP_INSTALL) -e '.[hf,test,plot,gym,trl,agents-sdk]' 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/python -c 'import skyrl_gym, trl, agents' && touch $@

# the 'trl' extra (TRL 1.16 and accelerate, datasets, ...), out of $(STAMP) as the gym extra is
$(VENV)/.trl: pyproject.toml | $(STAMP)
	$(PIP_INSTALL) -e '.[hf,test,plot,trl]' 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/python -c 'import trl' && touch $@

# The tiny model ships built (rayapp/inference/tiny-llama-v1); these rebuild it (minutes): `tiny-model` in
# place, after a change to its recipe; `check-tiny-model` aside, comparing it file by file with the shipped one.
tiny-model: $(STAMP)
	$(BIN)/python -m rayapp.cli.tiny_model_ship write

check-tiny-model: $(STAMP)
	$(BIN)/python -m rayapp.cli.tiny_model_ship check

# the 'bench' extra (matplotlib, which the 'plot' extra of every install brings already).
$(VENV)/.bench: pyproject.toml | $(STAMP)
	$(PIP_INSTALL) -e '.[hf,test,bench]' 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/python -c 'import matplotlib' && touch $@

bench: $(STAMP) $(VENV)/.bench
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/ray_pool.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/verify_cost.py
	$(BIN)/python bench/kv_reuse.py
	$(BIN)/python bench/gateway.py
	$(BIN)/python bench/gateway_flood.py
	$(BIN)/python bench/gateway_flood_serve.py
	$(BIN)/python bench/sim.py --plot docs
	$(BIN)/python bench/sim.py --nodes 8 --steps 5
	$(BIN)/python bench/sim_stream.py --nodes 8 --steps 8
	$(BIN)/python bench/chaos.py

clean:
	rm -rf $(VENV) $(SG_VENV) .pytest_cache .hypothesis .ruff_cache

# The real-engine lane (docs/testing.md): SGLang's CPU engine in its own venv (.venv-sglang), layered on
# .venv by a .pth file and installed --no-deps from a pinned list (no CUDA stack is pulled), with the
# sgl_kernel/torchvision stand-ins of tests/sglang_stub. Out of `make test`: it installs about 1.2 GB.
SG_VENV ?= .venv-sglang
$(SG_VENV)/.installed: tests/sglang_engine/requirements-cpu.txt | $(STAMP)
	test -x $(SG_VENV)/bin/python || $(BIN)/python -m venv --without-pip $(SG_VENV)
	$(BIN)/python -c 'import site; print(site.getsitepackages()[0])' > "$$($(SG_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/rayapp-main-venv.pth"
	$(BIN)/python -m pip --python $(SG_VENV)/bin/python install -q --no-deps -r tests/sglang_engine/requirements-cpu.txt 2>&1 | grep -v 'is ignored: it is neither' || true
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(CURDIR)/tests/sglang_stub $(SG_VENV)/bin/python -c 'import sglang, xgrammar' && touch $@

test-sglang: $(SG_VENV)/.installed
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(CURDIR):$(CURDIR)/tests/sglang_stub $(SG_VENV)/bin/python -m pytest tests/sglang_engine -p no:cacheprovider
