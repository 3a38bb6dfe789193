"""`launch.py reward-service CONFIG [--port P] [--host H] [--run-dir D] [--idle-exit-s S] [--slurm ...]`:
start a standalone reward service that scores reward requests from any number of runs, with the
`[reward]` section's pool settings (max_workers, idle_shutdown_s, scale_up_queue, executor) and service
limits (service_quota, service_max_request_bytes). It writes its address and a 0600 token into the
service dir; runs point at it with `reward.service_dir = D` (or `reward.service = host:port` and
$ROLLART_REWARD_TOKEN). It runs until SIGTERM or Ctrl-C, or with `--idle-exit-s S` until it has had no
request and no work for S seconds (it then removes its address file and exits).

`--slurm` submits the service as its own SLURM job instead (one task; `--partition`, `--time-min`):
the script (`D/reward_service.sbatch`, from `slurm/templates/reward_service.sbatch.in`) runs this
command on the node with `--host $(hostname)`, and `D/launch.json` records how to submit it again, so a
client that finds the service gone (idle exit) starts it on demand (`rollart_hpc.reward.ondemand`).
A job already pending or running for D is not submitted twice.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry.options import add_config_arguments

if TYPE_CHECKING:
    from rollart_hpc.config.schema import RewardConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser,
        "dotted overrides, e.g. reward.max_workers=4",
        config_help="TOML config whose [reward] section sets the pool and limits",
    )
    parser.add_argument("--run-dir", default="runs/reward-service", help="service dir: address, token, stats")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (a node name on SLURM)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    parser.add_argument(
        "--idle-exit-s",
        type=float,
        default=0.0,
        help="exit after this many seconds with no request and no work (default 0: never)",
    )
    parser.add_argument("--slurm", action="store_true", help="submit the service as its own SLURM job")
    parser.add_argument("--partition", default="", help="with --slurm: partition (default: the cluster's)")
    parser.add_argument("--time-min", type=int, default=60, help="with --slurm: job time limit in minutes")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.config import load_config

    if args.idle_exit_s < 0 or args.time_min < 1:
        raise UsageError("--idle-exit-s must be >= 0 and --time-min >= 1")
    if (args.partition or args.time_min != 60) and not args.slurm:
        raise UsageError("--partition and --time-min apply to --slurm")
    if args.slurm and (args.host != "127.0.0.1" or args.port):
        raise UsageError(
            "--slurm: the job listens on its node's host name and a free port; drop --host/--port"
        )
    config = load_config(args.config, args.overrides)
    check_reward_functions(config.reward, config.run.python_path)
    if args.slurm:
        return submit(args)
    return serve(config.reward, Path(args.run_dir), args.host, args.port, args.idle_exit_s)


def check_reward_functions(reward: RewardConfig, python_path: Sequence[str]) -> None:
    """Import the config's reward.functions (from run.python_path) now: a bad one is a one-line error."""
    from rollart_hpc.tasks.checks import check_reward_fn
    from rollart_hpc.tasks.plugins import add_python_path

    add_python_path(python_path)
    for family, path in reward.functions.items():
        check_reward_fn(f"reward.functions.{family}", path)


def submit(args: argparse.Namespace) -> int:
    """Render and submit the service's job; record the resubmission command in launch.json."""
    from rollart_hpc.cluster.sbatch import REPO_ROOT, SERVICE_SCRIPT, ServiceJob, render_service_job
    from rollart_hpc.contracts.atomic import atomic_write_bytes
    from rollart_hpc.reward import ondemand

    service_dir = Path(args.run_dir).resolve()
    job = ServiceJob(
        Path(args.config).resolve(),
        tuple(args.overrides),
        service_dir,
        args.time_min,
        args.idle_exit_s,
        partition=args.partition,
    )
    script = render_service_job(job)
    service_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(service_dir / SERVICE_SCRIPT, script.encode())
    ondemand.write_launch(service_dir, slurm.sbatch_command(str(service_dir / SERVICE_SCRIPT)), REPO_ROOT)
    job_id = ondemand.ensure_started(service_dir, by="launch.py reward-service --slurm")
    if job_id is None:
        live = ondemand.read_json(service_dir / ondemand.JOB_FILE) or {}
        print(f"reward service job {live.get('job_id', '?')} for {service_dir} is already pending or running")
    else:
        print(f"submitted reward service job {job_id}; address and token will be in {service_dir}")
    return 0


def serve(reward: RewardConfig, service_dir: Path, host: str, port: int, idle_exit_s: float) -> int:
    import asyncio

    from rollart_hpc.cluster.env import read_process_env
    from rollart_hpc.reward.ondemand import record_start
    from rollart_hpc.reward.service import RewardService
    from rollart_hpc.reward.wire import ADDRESS_FILE

    async def run() -> bool:
        service = RewardService(reward, service_dir, host=host, port=port, idle_exit_s=idle_exit_s)
        up = float(json.loads((service_dir / ADDRESS_FILE).read_text())["started"])
        start = record_start(service_dir, read_process_env().slurm_job_id, up)
        startup = f" ({start['startup_s']:.1f}s after submission)" if start else ""
        print(f"reward service at {service.address}{startup}; address and token in {service_dir}", flush=True)
        await service.run()
        return service.idle_expired()

    if asyncio.run(run()):
        print(f"reward service idle for {idle_exit_s:g}s: exited, address removed", flush=True)
    return 0
