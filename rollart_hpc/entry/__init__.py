"""rollart_hpc.entry."""
