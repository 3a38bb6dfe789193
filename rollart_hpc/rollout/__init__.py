"""rollart_hpc.rollout: the rollout role. A rollout rank serves one engine (`rollart_hpc.inference`) to the env
ranks and swaps in published weights between two engine steps.

- `main`: the rollout rank; `resilient`: engine failures survived by rebuilding; `costs`: what a rank measures
  of its engine for routing (load, prefill and decode costs) and the cost profile that stands in for other
  hardware on CPU.
"""
