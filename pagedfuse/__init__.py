"""pagedfuse: a torch.compile backend that swaps paged-KV attention for fused kernels."""

from pagedfuse import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
