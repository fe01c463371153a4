"""The Accelerate integration: ``NDParallelPlugin.attach(accelerator)`` routes an Accelerator's calls to the core.

Named after the library it integrates; inside this package ``import accelerate`` still means Hugging Face's
(absolute imports).
"""

from .plugin import NDParallelPlugin

__all__ = ["NDParallelPlugin"]
