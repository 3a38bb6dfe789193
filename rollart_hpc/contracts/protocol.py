"""Every MPI message tag of the system, in one registry (`Tag`); payloads are pickled objects.

Role messages of an RL run (records from `rollart_hpc.contracts.records` unless noted):

controller -> env       DISPATCH            EpisodeTicket
env -> rollout          GENERATE            (request_id, prompt_token_ids, SamplingParams)
env -> rollout          ABORT               request_id
rollout -> env          OUTPUT              RequestOutput
rollout -> env          LOAD                RankLoad: the rank's load and costs, sent just before each OUTPUT
env -> reward           SCORE               Trajectory (status ok)
reward -> controller    RESULT              Trajectory (scored)   [env -> controller for failed ones]
controller -> trainer   BATCH               TrainShard (this rank's share of step n)
trainer -> controller   TRAINED             StepReport of step n (trainer rank 0, after publishing n+1)
trainer -> rollout      WEIGHTS             WeightAnnouncement: version about to be broadcast
rollout -> controller   LOADED              version (int) now loaded by that engine
any -> any              STOP                reason (str); the receiver finishes its work and exits
rank -> controller      READY               Ready: the rank has set up (model loaded, groups joined)
controller -> all       START               TrainerStart (to trainers) or WorkerStart (to the others)
controller -> trainer   CHECKPOINT          directory (str) for the trainers' part of a run checkpoint
trainer -> controller   CHECKPOINTED        that directory (str): that part is written (controller.checkpoint_async: on every rank)
rank -> controller      STATS               RankStats: the rank's busy time, sent as it exits
controller -> env       CANCEL              episode id: end that episode now (a redundant straggler)

Infrastructure (not seen by role loops):

any -> watched ranks    HEARTBEAT           None; liveness, consumed by `Mailbox.poll`
trainer <-> trainer 0   TRAINER_RENDEZVOUS  node name / (host, port) of the trainers' group's TCPStore
rank <-> rank 0         BARRIER             None; `World.barrier`
rank <-> rank 0         RENDEZVOUS          any object; `World.bcast_from_root` / `gather_to_root`;
                                            the world group's TCPStore (`cluster.torchdist`)
member <-> member 0     WEIGHTS_GROUP       node name / (host, port) of the weights group's TCPStore
any -> any              SMOKE_HEARTBEAT     (rank, round) of the smoke job
"""

from __future__ import annotations

import enum


class Tag(enum.IntEnum):
    DISPATCH = 1
    GENERATE = 2
    ABORT = 3
    OUTPUT = 4
    SCORE = 5
    RESULT = 6
    BATCH = 7
    TRAINED = 8
    WEIGHTS = 9
    LOADED = 10
    STOP = 11
    READY = 12
    START = 13
    STATS = 14
    CHECKPOINT = 15
    CHECKPOINTED = 16
    LOAD = 17
    CANCEL = 18
    HEARTBEAT = 100
    TRAINER_RENDEZVOUS = 113
    SMOKE_HEARTBEAT = 200
    BARRIER = 9001
    RENDEZVOUS = 9002
    WEIGHTS_GROUP = 9101


# The tags a role loop's `Mailbox` carries (on its own communicator); infrastructure tags never reach it.
ROLE_TAGS: frozenset[Tag] = frozenset(Tag(value) for value in range(Tag.DISPATCH, Tag.CANCEL + 1))
