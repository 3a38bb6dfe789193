"""rollart_hpc.controller."""
