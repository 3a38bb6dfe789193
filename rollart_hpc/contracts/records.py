"""The records that cross role boundaries (MPI payloads, see `protocol.Tag`) and the stores.

Pure data, stdlib only. Each record is a dataclass with `to_dict` (plain JSON/pickle-friendly values)
and `from_dict` (the inverse); over MPI the records themselves are pickled.

Trajectory invariants (checked by `Trajectory.validate`):
- `token_ids`, `action_mask`, `logprobs` and `versions` have the same length;
- a token with mask 0 (system, template, observation, padding) has version -1 and log-prob 0.0;
- `llm_s`, `env_s` and `actions` have one entry per turn and `num_turns == len(actions)`;
- `status` is "ok" or "failed"; a failed trajectory has reward 0.0, success False and a failure cause.

A trajectory's `dispatch` dict is what the HDF5 store keeps of its ticket (`dispatch_json`): the
`EpisodeTicket` fields plus the env rank that ran it and the task's family (`EpisodeTicket.dispatch_record`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Self, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Status = Literal["ok", "failed"]

# Why an episode ended. "ok" trajectories end with one of OK_CAUSES, failed ones with FAILURE_CAUSES.
OK_CAUSES = ("done", "max_turns", "context_limit", "max_tokens")
FAILURE_CAUSES = ("crash", "timeout", "error", "llm_error", "abort", "reward_error", "agent_error")

DispatchValue = int | float | str | bool


def _pick(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `data` that are fields of the dataclass `cls` (extra keys are ignored)."""
    return {f.name: data[f.name] for f in fields(cls) if f.name in data}


class Record:
    """Base of the dataclass records: `to_dict` gives plain values, `from_dict` is its inverse (keys that
    are not fields are ignored); a record whose fields need conversion overrides them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(cast("DataclassInstance", self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        return cls(**_pick(cls, data))


@dataclass
class Trajectory(Record):
    """One episode as flat typed arrays plus scalars; see the module docstring for the invariants."""

    task_id: str
    family: str
    tags: tuple[str, ...]
    episode_id: str
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    actions: list[str] = field(default_factory=list)
    llm_s: list[float] = field(default_factory=list)
    env_s: list[float] = field(default_factory=list)
    reset_s: float = 0.0
    num_turns: int = 0
    env_return: float = 0.0
    env_won: bool = False
    reward: float = 0.0
    success: bool = False
    status: Status = "ok"
    finish_cause: str = ""
    error: str = ""
    dispatch: dict[str, DispatchValue] = field(default_factory=dict)

    @property
    def failure_cause(self) -> str:
        """The failure cause of a failed trajectory, "" for an ok one."""
        return self.finish_cause if self.status == "failed" else ""

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def append(self, ids: list[int], generated: bool, logprobs: list[float], versions: list[int]) -> None:
        """Append one segment; non-generated segments get version -1 and log-prob 0."""
        self.token_ids.extend(ids)
        self.action_mask.extend([1 if generated else 0] * len(ids))
        if generated:
            if len(logprobs) != len(ids) or len(versions) != len(ids):
                raise ValueError(
                    f"generated segment of {len(ids)} tokens has {len(logprobs)} logprobs, "
                    f"{len(versions)} versions"
                )
            self.logprobs.extend(float(x) for x in logprobs)
            self.versions.extend(int(v) for v in versions)
        else:
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))

    def validate(self) -> None:
        """Raise ValueError if an invariant of the module docstring does not hold."""
        n = len(self.token_ids)
        if not len(self.action_mask) == len(self.logprobs) == len(self.versions) == n:
            raise ValueError(f"trajectory {self.episode_id}: array lengths differ")
        for m, lp, v in zip(self.action_mask, self.logprobs, self.versions, strict=True):
            if m == 0 and (v != -1 or lp != 0.0):
                raise ValueError(f"trajectory {self.episode_id}: non-generated token with version {v}")
        if not len(self.llm_s) == len(self.env_s) == len(self.actions) == self.num_turns:
            raise ValueError(f"trajectory {self.episode_id}: per-turn lists disagree with num_turns")
        causes = OK_CAUSES if self.status == "ok" else FAILURE_CAUSES
        if self.finish_cause not in causes:
            raise ValueError(f"trajectory {self.episode_id}: cause {self.finish_cause!r} for {self.status}")
        if self.status == "failed" and (self.reward != 0.0 or self.success):
            raise ValueError(f"trajectory {self.episode_id}: failed trajectory carries a reward")

    def oldest_version(self) -> int:
        """The smallest policy version among generated tokens (-1 when none were generated)."""
        gen = [v for v, m in zip(self.versions, self.action_mask, strict=True) if m]
        return min(gen) if gen else -1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tags"] = list(self.tags)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trajectory:
        values = _pick(cls, data)
        values["tags"] = tuple(values["tags"])
        values["dispatch"] = dict(values.get("dispatch", {}))
        return cls(**values)


@dataclass(frozen=True)
class EpisodeTicket(Record):
    """controller -> env (DISPATCH): one episode to play, with its dispatch version v0, the tracker's
    policy event and the SPO++ baseline frozen at dispatch, and the episode's sampling seed. `group_id`:
    the group of the group estimator (GRPO) the episode belongs to, "" outside one."""

    episode_id: str
    task_id: str
    version: int
    event: int
    baseline: float
    seed: int
    dispatch_time: float
    group_id: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeTicket:
        """The inverse of `to_dict`; a field with a default may be absent (tickets saved before it existed)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING})

    def dispatch_record(self, env_rank: int, family: str) -> dict[str, DispatchValue]:
        """What the trajectory keeps of its ticket (stored in HDF5): the ticket, env rank and family."""
        return {**self.to_dict(), "env_rank": env_rank, "family": family}


@dataclass
class TrainShard(Record):
    """controller -> trainer (BATCH): one trainer rank's share of step `step` (lists: pickles without
    torch). `num_global_action_tokens` is the step's action-token count over all ranks (the loss
    denominator on every rank)."""

    step: int
    num_global_action_tokens: int
    tokens: list[list[int]] = field(default_factory=list)
    action_masks: list[list[int]] = field(default_factory=list)
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    seq_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WeightAnnouncement(Record):
    """trainer -> rollout (WEIGHTS): `version` is about to be broadcast on the weights group."""

    version: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightAnnouncement:
        return cls(int(data["version"]))


@dataclass(frozen=True)
class StepReport(Record):
    """trainer -> controller (TRAINED): step `step` is trained and version step + 1 published.
    `metrics`: the trainer's step metrics; `train_s`: seconds of the step on the first trainer."""

    step: int
    train_s: float
    metrics: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        """The report's columns of a metrics.jsonl row: the step metrics, then `train_s`."""
        return {**self.metrics, "train_s": self.train_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        return cls(int(data["step"]), float(data["train_s"]), dict(data.get("metrics", {})))


@dataclass(frozen=True)
class RankLoad(Record):
    """rollout -> env (LOAD), just before each OUTPUT to that env rank: what the rollout rank holds now
    and what its engine has done so far (counters are cumulative, so the newest report supersedes the
    older ones). `fit` holds the sums of a least-squares fit of step seconds t on the step's prefill
    tokens p and decode tokens d: (p*p, p*d, d*d, t*p, t*d); zeros where the engine does not say how a
    step splits (vLLM)."""

    rank: int
    pool: str
    requests: int
    tokens: int
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0
    steps: int = 0
    fit: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class RankStats(Record):
    """rank -> controller (STATS), as the rank exits: its role, its busy seconds, and how often the
    component it serves failed inside it and was replaced (rollout: engine failures and engine rebuilds;
    reward: failed reward calls and worker pool rebuilds)."""

    role: str
    busy_s: float
    failures: int = 0
    rebuilds: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankStats:
        counts = (int(data.get("failures", 0)), int(data.get("rebuilds", 0)))
        return cls(str(data["role"]), float(data["busy_s"]), *counts)


@dataclass(frozen=True)
class TrainerStart(Record):
    """controller -> trainer (START): the initial model, and the trainers' checkpoint part to resume
    from (None on a fresh run)."""

    model_dir: str
    resume: str | None = None


@dataclass(frozen=True)
class WorkerStart(Record):
    """controller -> rollout, env and reward ranks (START): the trainers' current model and its version."""

    model_dir: str
    version: int


@dataclass(frozen=True)
class Ready(Record):
    """rank -> controller (READY): set up. Trainers name the model they now hold and their set-up time."""

    model_dir: str | None = None
    setup_s: float = 0.0
