"""The benchmarks: each module is a script with a `main` (run from the repository root as `python -m
benchmarks.NAME` or `python benchmarks/NAME.py`); the few that use another one import it as `benchmarks.OTHER`, or,
run as a script, from their own folder, which Python puts first on sys.path."""
