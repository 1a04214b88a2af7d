"""Preflight: a layout at its full world size, checked and stepped on one CPU (docs/preflight.md)."""
