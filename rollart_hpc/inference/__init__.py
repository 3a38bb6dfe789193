"""rollart_hpc.inference: the inference engines, a library of the rollout role and of the reward role's judge.

- `api`: the engine contract (`Engine`); `engines`: the registry keyed by `rollout.engine`.
- `engine`: the built-in continuous-batching engine (`LLMEngine`); `decoder`, `packed`, `prefix_cache`,
  `sampling`: its parts; `async_engine`: an asyncio front end.
- `vllm_engine`, `vllm_staging`, `vllm_worker`: the vLLM 0.32 adapter.
The wire types of a generation (`SamplingParams`, `RequestOutput`) are `rollart_hpc.contracts.generation`.
"""
