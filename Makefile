.PHONY: demo test env

env:
	./scripts/setup-env.sh

# The main job: plain vs patched torchrun loads on CPU, side by side (see demo/run.py).
demo: env
	.venv/bin/python demo/run.py

# The test suite (multi-rank tests spawn real processes; each has a hard timeout).
test: env
	.venv/bin/python -m pytest -q tests
