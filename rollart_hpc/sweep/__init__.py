"""Sweeps: a grid of runs over seeds (`grid`), run locally (`local`) or as one SLURM job array (`array`).
The command is `launch.py sweep` (`rollart_hpc.entry.sweep`)."""
