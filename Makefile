# Every target sets up .venv itself (see scripts/dev.py); only python3 is needed.
PYTHON ?= python3

.PHONY: demo test bench bench-full clean

demo:
	$(PYTHON) scripts/dev.py demo

test:
	$(PYTHON) scripts/dev.py test

bench:
	$(PYTHON) scripts/dev.py bench

bench-full:
	$(PYTHON) scripts/dev.py bench-full

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
