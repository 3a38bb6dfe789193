"""The scale simulator: a discrete-event model of the pipeline (SimPy), calibrated on a run's controller trace."""
