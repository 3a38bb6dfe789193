"""The dependency set: requirements.lock agrees with pyproject.toml, and nothing at the repository root
shadows an installed distribution's module (the root is on sys.path under pytest and `python launch.py`)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
# Pinned in pyproject.toml itself (the CPU or the CUDA build, by machine), so the lock leaves them out.
NOT_LOCKED = {"torch", "triton"}


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate((REPO / "requirements.lock").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line.strip())
        assert m, f"requirements.lock:{n}: not `name==version`: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"requirements.lock:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]


def test_the_lock_pins_every_declared_dependency_inside_its_range():
    pins = _lock()
    declared = [r for r in _declared() if r.marker is None or r.marker.evaluate()]
    checked = 0
    for req in declared:
        name = canonicalize_name(req.name)
        if name in NOT_LOCKED:
            assert name not in pins, f"{name} is pinned in pyproject.toml, not in requirements.lock"
            continue
        assert name in pins, f"requirements.lock has no pin for {req}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]} outside pyproject.toml's {req}"
        )
        checked += 1
    assert checked >= 20
    assert "rollart-hpc" not in pins


def test_the_lock_rejects_what_pyproject_excludes():
    # The check above can fail: a pin outside a declared range is caught.
    req = Requirement("transformers>=5.0")
    assert not req.specifier.contains("4.57.1")
    assert req.specifier.contains(_lock()["transformers"])


def test_nothing_at_the_repository_root_shadows_an_installed_module():
    owners = importlib.metadata.packages_distributions()
    ours = {"rollart_hpc"}
    clashes = []
    for entry in sorted(REPO.iterdir()):
        name = entry.stem if entry.suffix == ".py" else entry.name
        if entry.name.startswith(".") or name in ours:
            continue
        others = [d for d in owners.get(name, []) if canonicalize_name(d) != "rollart-hpc"]
        if others:
            clashes.append(f"{entry.name} shadows the module `{name}` of {sorted(set(others))}")
    assert not clashes, "\n".join(clashes)
    # The scan sees the installed distributions' modules.
    assert "transformers" in owners
