"""rollart_hpc.envs: multi-turn text environments, env workers and the agent loop.

- `types`: `Task`, `Env` (reset/step), `AsyncEnv`, `EnvError`, `Trajectory`.
- `registry`: `FAMILIES` (household, calc_math, frozenlake), `make_family`, `FamilySpec`.
- `agent_loop`: `AgentConfig`, `run_episode` (chat template, action mask, log-probs, versions).
- `worker`: `EnvWorker`, `EnvWorkerConfig` (child processes, time limits); `faults`: `FaultConfig`.
- `demos`: `run_oracle`, `demonstration_messages`, `demonstration_trajectory`, `ScriptedClient`.
- `household_data`: the prepared game cache (`launch.py envs prepare`).
Importing this package imports nothing heavy; TextWorld, gymnasium and transformers load on use.
"""
