"""layerdrop: a graph-rewriting compiler that removes redundant layers from exported LLMs."""

from layerdrop.errors import LayerdropError

__all__ = ["LayerdropError", "__version__"]
__version__ = "0.1.0"
