"""Triton kernels with their torch references (installed as rollart_hpc.kernels)."""
