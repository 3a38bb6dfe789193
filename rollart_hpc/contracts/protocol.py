"""Message tags between the roles of an RL run (MPI point-to-point; payloads are pickled objects).

controller -> env       DISPATCH      EpisodeTicket as dict, with the task id
env -> rollout          GENERATE      (request_id, prompt_token_ids, SamplingParams)
env -> rollout          ABORT         request_id
rollout -> env          OUTPUT        RequestOutput
env -> reward           SCORE         Trajectory (status ok)
reward -> controller    RESULT        Trajectory (scored)   [env -> controller for failed ones]
controller -> trainer   BATCH         TrainShard (this rank's share of step n)
trainer -> controller   TRAINED       StepReport of step n (trainer rank 0, after publishing n+1)
trainer -> rollout      WEIGHTS       version about to be broadcast on the weights group
rollout -> controller   LOADED        version now loaded by that engine
any -> any              STOP          reason; the receiver finishes its work and exits
rank -> controller      READY         the rank has set up (model loaded, groups joined)
controller -> all       START         model directory and facts every rank needs
controller -> trainer   CHECKPOINT    directory for the trainers' part of a run checkpoint
trainer -> controller   CHECKPOINTED  that part is written
rank -> controller      STATS         the rank's busy time, sent as it exits
"""

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
