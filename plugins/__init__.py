"""Integrations of nd_parallel with host frameworks, installed as ``nd_parallel.plugins``."""
