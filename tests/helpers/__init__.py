"""Shared test helpers: case builders, tolerances and compilers used by several test files."""
