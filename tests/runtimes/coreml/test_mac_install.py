"""anelab installs on every macOS the runbook promises (15, 26, 27 on Apple silicon, Python 3.11): pip's resolver,
asked for Mac wheels only, finds every pin of pyproject.toml (and environment.yml lists the same pins).

pip's ``--platform`` changes the wheel tags it accepts, not the environment markers it evaluates (those are this
machine's), so each requirement's marker is evaluated here for the Mac first and the Mac's requirements are then
resolved with their dependencies (``pip install --dry-run --only-binary=:all: --platform macosx_<N>_0_arm64``). It
needs the package index (CI reaches it); the three resolves run side by side (about 15 s here with a warm cache).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
# macOS -> its Darwin kernel release (platform_release in a marker): macOS 15 is Darwin 24, 26 is 25, 27 is 26
MACS = {15: "24.0.0", 26: "25.0.0", 27: "26.0.0"}
COREAI_FROM = 26  # coreai-core 1.0.0b3: wheels for Linux and macosx_26_0_arm64 only
RESOLVE_TIMEOUT_S = 240


def _mac_environment(macos: int, extra: str = "") -> dict:
    env = default_environment()
    env.update(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64", os_name="posix",
               platform_release=MACS[macos], python_version="3.11", python_full_version="3.11.9",
               implementation_name="cpython", platform_python_implementation="CPython", extra=extra)  # fmt: skip
    return env


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def mac_requirements(macos: int, extras: tuple[str, ...] = ()) -> list[str]:
    """pyproject.toml's requirements (and ``extras``') that apply on this Mac, without their markers."""
    project = _project()
    listed = [(r, "") for r in project["dependencies"]]
    listed += [(r, extra) for extra in extras for r in project["optional-dependencies"][extra]]
    out = []
    for text, extra in listed:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(_mac_environment(macos, extra)):
            out.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
    return out


def _pip(macos: int, requirements: list[str], work: Path, *, deps: bool = True) -> subprocess.Popen:
    report = work / f"report-{macos}-{len(requirements)}-{deps}.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--only-binary=:all:",
           "--platform", f"macosx_{macos}_0_arm64", "--python-version", "3.11", "--implementation", "cp",
           "--target", str(work / f"target-{macos}"), "--report", str(report), *([] if deps else ["--no-deps"]),
           *requirements]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.report = report  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, set[str], str]:
    _, err = proc.communicate(timeout=RESOLVE_TIMEOUT_S)
    errors = [line for line in err.splitlines() if line.startswith("ERROR")]
    names = set()
    if proc.returncode == 0:
        names = {i["metadata"]["name"].lower() for i in json.loads(proc.report.read_text())["install"]}
    return proc.returncode, names, " | ".join(errors)[:400]


def test_the_full_dependency_set_resolves_for_macos_15_26_and_27_on_apple_silicon(tmp_path):
    wanted = {macos: mac_requirements(macos, ("coreai",) if macos >= COREAI_FROM else ()) for macos in MACS}
    running = {macos: _pip(macos, reqs, tmp_path) for macos, reqs in wanted.items()}
    control = _pip(15, ["coreai-core==1.0.0b3"], tmp_path, deps=False)  # the old unconditional pin on macOS 15
    results = {macos: _finish(proc) for macos, proc in running.items()}
    for macos, (code, names, errors) in results.items():
        assert code == 0, f"macOS {macos}: the dependency set does not resolve: {errors}"
        assert {"coremltools", "mlx", "mlx-lm", "numpy", "transformers"} <= names, (macos, sorted(names))
        assert ("coreai-core" in names) == (macos >= COREAI_FROM), macos
    code, _, errors = _finish(control)
    assert code != 0 and "coreai-core" in errors  # negative control: this check fails on an unresolvable pin


def test_coreai_core_applies_on_linux_and_as_the_macs_extra_only():
    on_15 = mac_requirements(15)
    assert not any(r.startswith("coreai-core") for r in on_15)
    assert "coreai-core==1.0.0b3" in mac_requirements(26, ("coreai",))
    linux = default_environment() | {"sys_platform": "linux", "extra": ""}
    assert any(Requirement(r).name == "coreai-core" and Requirement(r).marker.evaluate(linux)
               for r in _project()["dependencies"])  # fmt: skip


def _pins(lines) -> set[str]:
    return {re.sub(r"\s+", "", line) for line in lines}


def test_environment_yml_lists_pyprojects_pins():
    text = (ROOT / "environment.yml").read_text()
    listed = [m.group(1) for m in re.finditer(r'^\s+- "([^"]+)"', text, re.M)]
    project = _project()
    expected = _pins(project["dependencies"]) | _pins(r for r in project["optional-dependencies"]["test"]
                                                       if not r.startswith("ruff"))  # fmt: skip
    assert expected <= _pins(listed), sorted(expected - _pins(listed))


@pytest.mark.parametrize("macos", [15, 26])
def test_mac_requirements_drop_the_linux_only_pins(macos):
    reqs = mac_requirements(macos)
    assert "mlx==0.32.4" in reqs and not any(r.startswith("mlx[cpu]") for r in reqs)
