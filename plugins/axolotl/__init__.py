"""Axolotl plugin: ``plugins: [nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin]`` in an Axolotl YAML."""

from .plugin import NDParallelAxolotlPlugin

__all__ = ["NDParallelAxolotlPlugin"]
