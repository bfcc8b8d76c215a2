# Shorthands for the project's scripts (the scripts are what CI and the README run).
.PHONY: test bench

test:
	bash scripts/test

bench:
	bash bench/run_all.sh
