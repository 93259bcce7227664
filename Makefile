# qgather: `make run` runs the suite on whatever hardware is present, `make test` runs the tests.
# Both create .venv and install everything on first use. On a host without a package registry
# (the GPU host), pass an interpreter that already has torch: `make test-multigpu PY=python3`.

VENV ?= .venv
PY ?= $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_WORKERS ?= 2
GPU_IMPLS ?= reference,torchao,te,te:delayed
# Bounds each GPU case: a HANG (e.g. TE's blockwise uneven shards on NCCL) otherwise waits the
# backend's default (120 s on NCCL), which alone can blow the job's 10-minute budget.
GPU_CASE_TIMEOUT ?= 30
# pytest-xdist workers of the GPU job: each keeps its own warm pools on the same GPUs (a case is small
# next to a GPU; the job's time is the host's: TE's Python, pool starts, a failed rank's wait).
# Half the host's cores (a worker's 2-rank pool keeps two busy), at most 8: on one H100 with 16
# cores the te gate took 160 s with 4 workers and 136 s with 8 (docs/gpu-results.md).
GPU_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n / 2)); [ $$n -gt 8 ] && n=8; [ $$n -lt 1 ] && n=1; echo $$n)

ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(STAMP)
else
SETUP :=
endif

.PHONY: run test gate-cpu gate-torchao gate-torch test-torch test-multigpu selftest bench golden golden-check lint clean repro-docs

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

# Every target that runs a qgather command ends its recipe with $(KEEP_RC). GNU make exits 2 for any
# failed recipe and cannot exit with the recipe's own code, so a failure's last line names the tool's
# code (README's "Exit codes"), and .ci/make-rc, which sets QGATHER_RC_FILE, exits with it.
KEEP_RC = rc=$$?; [ -z "$${QGATHER_RC_FILE:-}" ] || echo $$rc > "$$QGATHER_RC_FILE"; \
  [ $$rc -eq 0 ] || { echo "make: qgather exited $$rc" >&2; exit $$rc; }

run: $(SETUP)
	@$(PY) -m qgather run -n $(PYTEST_WORKERS); $(KEEP_RC)

# pytest's exit 5 ("no tests collected") would be a broken suite: fail loudly on it.
# --dist loadgroup: tests spread one at a time as with the default, except that an xdist_group (a module
# whose module-scoped fixture or memo is expensive: the wheel build, the selftest's cases) runs on one
# worker, and groups are handed out first, so no long unit starts at the end.
# The runner-kill tests run alone afterwards: they bound how long a killed runner's processes and
# temp dirs survive it (5 s), which a loaded neighbour stretches. (Under xdist they once left dirs
# behind: pytest's deeper tmp_path made the forkserver's socket path too long, and the runner fell
# back to spawn without a word; runtime.helpers.fit_socket_path fixed that.)
test: $(SETUP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not gpu and not slow and not isolated" -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; rc=1; fi; \
	  if [ $$rc -eq 0 ]; then $(PY) -m pytest -m "isolated and not gpu" -p no:cacheprovider -q $(PYTEST_ARGS); rc=$$?; \
	    if [ $$rc -eq 5 ]; then echo "make test: no isolated tests collected" >&2; rc=1; fi; fi; \
	  (exit $$rc); $(KEEP_RC)

# The documented CPU gate on torchao (CI runs it after `make test`): every torchao case on gloo, gated
# on the checked-in baseline, so that a new scenario or world size cannot turn it red unnoticed.
gate-cpu: $(SETUP)
	$(PY) -m qgather run --impl torchao --baseline known-issues.toml -n $(PYTEST_WORKERS) --report-dir reports/gate-cpu; \
	  $(KEEP_RC)

# The CPU suite against another torch release, in a venv of its own (not part of CI): e.g.
# `make test-torch TORCH=2.15.0`. A release past this machine's local pip cap (a constraints file in
# pip's site configuration) comes from the package registry, configuration ignored: a CUDA build of
# several GB.
TORCH ?=
TORCH_VENV ?= .venv-torch-$(TORCH)
test-torch:
	@test -n "$(TORCH)" || { echo "make test-torch: name a torch release, e.g. TORCH=2.15.0" >&2; exit 2; }
	test -x $(TORCH_VENV)/bin/python || python3 -m venv $(TORCH_VENV)
	echo "torch==$(TORCH)" > $(TORCH_VENV)/torch-constraint.txt
	$(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/torch-constraint.txt -e '.[dev]' \
	  || PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/torch-constraint.txt -e '.[dev]'
	$(TORCH_VENV)/bin/python -c 'import torch; print("make test-torch: torch", torch.__version__)'
	$(MAKE) test PY=$(TORCH_VENV)/bin/python

# A gate against another release of a library, each in a venv of its own (not part of CI), its reports in
# a folder named after the release: `make gate-torchao TORCHAO=0.16.0` runs the torchao gate (as gate-cpu
# does, with CI's torch) into reports/torchao-0.16.0/; `make gate-torch TORCH=2.15.0` runs the reference
# suite into reports/torch-2.15.0/. `qgather compare reports/torchao-0.17.0 reports/torchao-0.18.0` then
# says what the upgrade fixed and what it broke (README, "Gating an upgrade"). The baseline's entries are
# for this checkout's versions: under another release a stale entry fails the gate, the reports are
# still written (compare reads the verdicts, not the gate's exit status). A release past this machine's
# local pip cap comes from the package registry, configuration ignored, as in test-torch.
TORCHAO ?=
GATE_BASELINE ?= known-issues.toml
# $(call gate,VENV,CONSTRAINTS,REQUIREMENT,IMPL,REPORT DIR): make the venv, install, run the gate
define gate
test -x $(1)/bin/python || python3 -m venv $(1)
$(1)/bin/python -m pip install -q -c $(2) -e . '$(3)' \
  || PIP_CONFIG_FILE=/dev/null $(1)/bin/python -m pip install -q -c $(2) -e . '$(3)'
$(1)/bin/python -c 'import torch, importlib.metadata as m; print("gate:", "torch", torch.__version__, "torchao", \
  next((d.version for d in m.distributions() if d.metadata["Name"] == "torchao"), "not installed"))'
$(1)/bin/python -m qgather run --impl $(4) --baseline $(GATE_BASELINE) -n $(PYTEST_WORKERS) --report-dir $(5); \
  $(KEEP_RC)
endef

gate-torchao:
	@test -n "$(TORCHAO)" || { echo "make gate-torchao: name a torchao release, e.g. TORCHAO=0.17.0" >&2; exit 2; }
	$(call gate,.venv-torchao-$(TORCHAO),constraints-cpu.txt,torchao==$(TORCHAO),torchao,reports/torchao-$(TORCHAO))

# Not constraints-cpu.txt: a CUDA build of torch pins its own triton (as in test-torch).
gate-torch:
	@test -n "$(TORCH)" || { echo "make gate-torch: name a torch release, e.g. TORCH=2.15.0" >&2; exit 2; }
	mkdir -p $(TORCH_VENV) && echo "torch==$(TORCH)" > $(TORCH_VENV)/torch-constraint.txt
	$(call gate,$(TORCH_VENV),$(TORCH_VENV)/torch-constraint.txt,torch==$(TORCH),reference,reports/torch-$(TORCH))

# The GPU gating job: the case suite on CUDA (NCCL one rank per GPU, gloo on CUDA tensors for
# more ranks than GPUs) plus the GPU-only tests (TransformerEngine cross-checks). The xdist workers share
# every GPU: each rank of a CUDA pool takes one of a GPU's QGATHER_GPU_SEATS seats (qgather.runtime.gpu_lease),
# and a worker keeps its pools warm; with TE among GPU_IMPLS, the ranks' forkserver preloads TE where
# that is fork-safe.
# With an interpreter that does not have qgather installed (a GPU host without a package registry,
# PY=python3), .qgather-path/ makes the checkout importable as an install is: a link qgather ->
# harness/qgather/ and a dist-info whose pytest11 entry point loads the plugin.
QGATHER_LINK := .qgather-path
# Installed means pytest finds the plugin's entry point: a checkout on PYTHONPATH imports but loads no plugin.
QGATHER_INSTALLED = $(PY) -c 'import importlib.metadata as m, sys; \
  sys.exit(not any(e.name == "qgather" for e in m.entry_points(group="pytest11")))' 2>/dev/null
test-multigpu: $(SETUP)
	@$(QGATHER_INSTALLED) || { mkdir -p $(QGATHER_LINK)/qgather-0.dist-info \
	  && ln -sfn ../harness/qgather $(QGATHER_LINK)/qgather \
	  && printf 'Metadata-Version: 2.1\nName: qgather\nVersion: 0\n' > $(QGATHER_LINK)/qgather-0.dist-info/METADATA \
	  && printf '[pytest11]\nqgather = qgather.pytest_plugin\n' > $(QGATHER_LINK)/qgather-0.dist-info/entry_points.txt; }
	@( if $(QGATHER_INSTALLED); then path=; else path="$(CURDIR)/$(QGATHER_LINK)"; fi; \
	  export PYTHONPATH="$${path:+$$path:}$$PYTHONPATH"; set -e; \
	  $(PY) -m qgather gpu-check; \
	  case ",$(GPU_IMPLS)," in *,te*) [ -n "$${QGATHER_FORKSERVER_PRELOAD+set}" ] || export QGATHER_FORKSERVER_PRELOAD=$$( \
	    $(PY) -c 'from qgather.runtime.helpers import fork_safe; print(",".join(fork_safe(["transformer_engine.pytorch"])))' \
	    2>/dev/null); echo "forkserver preloads: $${QGATHER_FORKSERVER_PRELOAD:-torch only}";; esac; \
	  $(PY) -m pytest cases tests/gpu -m "gpu or not slow" --device cuda --impl $(GPU_IMPLS) -n $(GPU_WORKERS) \
	    --case-timeout $(GPU_CASE_TIMEOUT) -p no:cacheprovider -p no:benchmark -q -rs --qgather-summary $(PYTEST_ARGS) ); \
	  $(KEEP_RC)

selftest: $(SETUP)
	$(PY) -m qgather selftest; $(KEEP_RC)

bench: $(SETUP)
	$(PY) -m qgather bench; $(KEEP_RC)

golden: $(SETUP)
	$(PY) -m qgather golden; $(KEEP_RC)

# The import layers (pyproject.toml's [tool.importlinter]): lint-imports, run through $(PY) so that a
# PY without a venv's scripts works too, on this checkout's harness/ (not an installed qgather).
lint: $(SETUP)
	$(PY) -m ruff check harness tests cases conftest.py setup.py
	PYTHONPATH=harness $(PY) -c 'from importlinter.cli import lint_imports_command; lint_imports_command()' --no-cache --no-logo

clean:
	rm -rf $(VENV) .venv-torch-* .venv-torchao-* $(QGATHER_LINK) *.egg-info build .pytest_cache .ruff_cache reports

# The findings' standalone scripts (docs/repro/) and upstream drafts (docs/upstream/), from
# qgather.tools.standalone.findings; tests/test_standalone_docs.py fails while they are stale.
repro-docs: $(SETUP)
	PYTHONPATH=harness $(PY) -m qgather.tools.standalone; $(KEEP_RC)
