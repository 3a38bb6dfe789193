"""rollart_hpc.cluster."""
