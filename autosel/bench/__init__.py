"""Benchmarks of autosel's own costs, each a module runnable with `python -m autosel.bench.<name>`."""
