"""rollart_hpc.tasks.families."""
