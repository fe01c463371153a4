"""The package version (one place: setup.py reads it, the agreement check compares it across ranks)."""

__version__ = "0.1.0"
