"""The benchmark harness: the engine against what users would pick instead, and `auto` against
every fixed gamma. Entries: `+job=bench` / `+job=bench_quick` (runner.py, the matrix),
benchmarks/gamma_policy.py (gamma_policy.py) and benchmarks/engine_speed.py (the matrix on random
prompts). Results go to benchmarks/RESULTS.md with their command, commit and machine."""
