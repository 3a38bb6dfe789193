"""rollart_hpc.envs: the env role. Env ranks run many episodes at once, each env in a child process with time
limits, and send every LLM turn to a rollout rank.

- `main`: the env rank (tickets from the controller, turns routed to rollout ranks, trajectories to reward ranks).
- `worker`: `EnvWorker`, `EnvWorkerConfig` (child processes, time limits); `child`: the child process;
  `faults`: `FaultConfig`.
- `baseline`: scripted household policies (`launch.py envs baseline`); `cli`: `launch.py envs ...`.
The tasks, env families and the agent loop they play are the library `rollart_hpc.tasks`.
"""
