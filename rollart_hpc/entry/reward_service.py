"""`launch.py reward-service CONFIG [--port P] [--host H] [--run-dir D]`: start a standalone reward service
(a local process) that scores reward requests from any number of runs, with the `[reward]` section's pool
settings (max_workers, idle_shutdown_s, scale_up_queue, executor) and service limits (service_quota,
service_max_request_bytes). It writes its address and a 0600 token into the service dir; runs point at
it with `reward.service_dir = D` (or `reward.service = host:port` and $ROLLART_REWARD_TOKEN). It runs
until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config whose [reward] section sets the pool and limits")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.max_workers=4")
    parser.add_argument("--run-dir", default="runs/reward-service", help="service dir: address, token, stats")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (a node name on SLURM)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")


def main(args: argparse.Namespace) -> int:
    import asyncio

    from rollart_hpc.config import load_config
    from rollart_hpc.reward.service import RewardService

    config = load_config(args.config, args.overrides)
    service_dir = Path(args.run_dir)

    async def serve() -> None:
        service = RewardService(config.reward, service_dir, host=args.host, port=args.port)
        print(f"reward service at {service.address}; address and token in {service_dir}", flush=True)
        await service.run()

    asyncio.run(serve())
    return 0
