"""graphcap backend plugin for CUDA devices (torch.cuda graphs).

Importing this package only imports torch, which is safe on machines without CUDA: the backend
then reports itself unavailable with the reason instead of failing.
"""

from graphcap_cuda.backend import CUDABackend

__all__ = ["CUDABackend"]
