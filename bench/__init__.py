"""Benchmarks shipped with the CLI (`halserve bench ...`)."""
