"""Benchmarks an operator runs on a deployment: `pdserve bench offline|serve|accuracy` (bench/cli.py), and
soak.py, migration.py, startup.py. Micro-benchmarks and developer tools are in bench/micro/."""
