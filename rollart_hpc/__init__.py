"""rollart_hpc: asynchronous, disaggregated, multi-task agentic RL on SLURM clusters (RollArt + SPO++)."""

__version__ = "0.1.0"
