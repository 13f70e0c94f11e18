"""Benchmarks and the emulated cluster."""
