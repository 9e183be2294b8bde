# Every target sets up .venv itself (see scripts/dev.py); only python3 is needed.
PYTHON ?= python3

.PHONY: demo test docs bench bench-full clean

demo:
	$(PYTHON) scripts/dev.py demo

test:
	$(PYTHON) scripts/dev.py test

docs:
	$(PYTHON) scripts/dev.py docs

bench:
	$(PYTHON) scripts/dev.py bench

bench-full:
	$(PYTHON) scripts/dev.py bench-full

clean:
	rm -rf .venv build site *.egg-info .pytest_cache .hypothesis
