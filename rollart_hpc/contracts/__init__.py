"""rollart_hpc.contracts."""
