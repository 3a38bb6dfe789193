"""rollart_hpc.metrics."""
