"""rollart_hpc.weights."""
