.PHONY: demo test test-tf5 test-tf4 env env-tf4

env:
	./scripts/setup-env.sh

# .venv-tf4: the same package on the last transformers 4.x line (4.57) and huggingface_hub 0.x.
env-tf4:
	./scripts/setup-env-tf4.sh

# The main job: plain vs patched torchrun loads on CPU, side by side (see demo/run.py).
demo: env
	.venv/bin/python demo/run.py

# The test suite (multi-rank tests spawn real processes; each has a hard timeout) on
# transformers 5.x, then its `tf4`-marked subset (downloads and loads) on transformers 4.57.
test: test-tf5 test-tf4

test-tf5: env
	.venv/bin/python -m pytest -q -rs --durations=25 tests

test-tf4: env-tf4
	.venv-tf4/bin/python -m pytest -q -rs -m tf4 tests
