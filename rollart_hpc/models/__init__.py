"""rollart_hpc.models."""
