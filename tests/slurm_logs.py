"""What a job script's log says about its srun step (shared by the slurm-marked tests).

A step succeeded when srun exited 0, or when srun hung after the step (a known Slurm 22.05 bug) and
`srun_watch` killed it after every rank had written its exit record: the job script then counts the step
as a success (slurm/templates/hetjob.sbatch.in)."""

SRUN_EXITED_0 = "[slurm] step exited with status 0"
HUNG_SRUN_FINISHED = "[slurm] every rank had finished before srun hung: the step counts as a success"


def step_succeeded(log: str) -> bool:
    return SRUN_EXITED_0 in log or HUNG_SRUN_FINISHED in log
