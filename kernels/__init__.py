"""Compute kernels: torch references (CPU path and test oracle); Triton kernels for the GPU."""
