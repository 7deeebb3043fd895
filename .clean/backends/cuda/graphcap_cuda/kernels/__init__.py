"""The plugin's Triton kernels, each a torch custom op, and the launch rule they share.

Nothing is imported here: ``launch`` needs only torch, the kernel modules need Triton, and the
backend imports each where it is used so that a torch build without Triton still loads it.
"""
