"""rollart_hpc.tasks: the task library shared by the roles (env, controller, trainer, reward): what a task is,
the env families, the agent loop, demonstrations and the episode id grammar. It imports no role.

- `types`: `Task`, `Env` (reset/step), `AsyncEnv`, `EnvError`, `Trajectory`.
- `registry`: `BUILTIN_FAMILIES` (household, calc_math, frozenlake: factory and reward by import path),
  `make_family`, `FamilySpec`; `build`: a run's families and tasks (built-in, envs.plugins, envs.datasets);
  `plugins`: objects by import path; `checks`: the run's own code and data checked when it starts;
  `rewards`: what a reward function sees and returns.
- `families/`: household (TextWorld), calc_math (answer checking included), frozenlake, `dataset` (task
  files), `gym_text` (text gymnasium envs); `household_data`: the prepared game cache (`launch.py envs prepare`).
- `agent_loop`: `AgentConfig`, `run_episode` (chat template, action mask, log-probs, versions); `chat`.
- `demos`: `run_oracle`, `demonstration_messages`, `demonstration_trajectory`, `ScriptedClient`.
- `episodes`: the episode id grammar (evaluation rounds, greedy plays).
Importing this package imports nothing heavy; TextWorld, gymnasium and transformers load on use.
"""
