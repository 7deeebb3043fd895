"""The built-in CPU reference backend: real graph semantics without an accelerator."""

from graphcap.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
