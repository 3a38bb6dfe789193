"""rollart_hpc.reward: stateless reward functions per env family and a concurrent reward pool."""
