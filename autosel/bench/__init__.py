"""Benchmarks a user runs on their own machine (`autosel bench ...`), each writing one result file with its
provenance (autosel.bench.results), and the benchmarks page rendered from those files (autosel.bench.page).

Importing this package imports no torch: each benchmark module imports what it measures when it runs.
"""
