"""rollart_hpc.routing: the routing policy of LLM turns to rollout pools and ranks, a library of the env role
(each env rank routes its own turns) and of the simulator.

- `router`: `Router`, `PoolSpec`, `episode_of` (hash, static and adaptive policies).
- `affinity`: adaptive affinity as pure functions (per-pool costs from LOAD reports, the shares decided).
"""
