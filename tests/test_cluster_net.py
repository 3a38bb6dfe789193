"""[cluster.net]: validation, this node's address on a named interface, the rendezvous host, and the
variables the local launcher hands to the ranks."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollart_hpc.cluster.env import interface_address, store_host
from rollart_hpc.cluster.mpiexec import mpi_environment
from rollart_hpc.cluster.torchdist import store_address
from rollart_hpc.config.loader import apply_overrides, build
from rollart_hpc.config.schema import Config, NetConfig
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
UNKNOWN = "nosuchif0"


def _net(*overrides: str) -> NetConfig:
    return build(Config, apply_overrides({}, [f"cluster.net.{o}" for o in overrides])).cluster.net


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("nccl_env={IB_HCA = 'mlx5_0'}", r"^cluster\.net\.nccl_env\.IB_HCA: keys are NCCL_ variables"),
        (
            "nccl_env={NCCL_SOCKET_IFNAME = 'ib0'}",
            r"^cluster\.net\.nccl_env\.NCCL_SOCKET_IFNAME: set cluster",
        ),
        (
            "gloo_socket_ifname='eth0,eth1'",
            r"^cluster\.net\.gloo_socket_ifname: 'eth0,eth1' is not a network",
        ),
        ("nccl_env={NCCL_DEBUG = 1}", r"^cluster\.net\.nccl_env\.NCCL_DEBUG: expected str, got int"),
    ],
)
def test_bad_network_settings_are_refused_with_their_key(override: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _net(override)


def test_environment_holds_the_named_interfaces_and_the_nccl_extras() -> None:
    assert _net().environment() == {}
    net = _net("gloo_socket_ifname=lo", "nccl_env={NCCL_DEBUG = 'WARN'}")
    assert net.environment() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}
    env = mpi_environment(net.environment())
    assert (
        env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_DEBUG"] == "WARN" and env["PYTHONUNBUFFERED"] == "1"
    )


def test_store_host_is_this_nodes_address_on_the_named_interface() -> None:
    assert interface_address("lo", "k") == "127.0.0.1"
    assert store_host(_net("nccl_socket_ifname=lo")) == "127.0.0.1"
    assert store_host(_net("gloo_socket_ifname=lo", f"nccl_socket_ifname={UNKNOWN}")) == "127.0.0.1"
    assert store_host(_net()) == ""
    with pytest.raises(
        UsageError, match=rf"^cluster\.net\.nccl_socket_ifname: no network interface '{UNKNOWN}'"
    ):
        store_host(_net(f"nccl_socket_ifname={UNKNOWN}"))
    assert store_address(SimpleNamespace(store_host="127.0.0.1")) == "127.0.0.1"  # type: ignore[arg-type]
    fallback = socket.gethostbyname(socket.gethostname())
    assert store_address(SimpleNamespace(store_host="")) == fallback  # type: ignore[arg-type]


def test_local_run_with_an_unknown_interface_is_a_one_line_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "run", "configs/smoke.toml", "--run-dir", str(run_dir),
         f"cluster.net.gloo_socket_ifname={UNKNOWN}"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: cluster.net.gloo_socket_ifname: no network interface '{UNKNOWN}'")
    assert not run_dir.exists()
