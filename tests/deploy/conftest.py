"""`docker compose up` for real: images built here, the whole file started, torn down.

These tests need a Docker engine with Compose v2 (`deploy/local/engine.sh` gives
this machine one, as root). Without one they skip, unless LLMGW_REQUIRE_COMPOSE=1
(CI), where a missing engine is a failure. They are deselected from the default
run (`-m "not compose"` in pyproject) and run with `pytest -m compose`.

No image registry is reachable from the build machines, so the images are our
own (`deploy/local/build-images.sh`: Debian's and PyPI's packages, tags
llmgw-test/NAME:local); docker-compose.yml is pointed at them through its
LLMGW_*_IMAGE variables and run with tests/deploy/compose.test.yml on top:
loopback-only ports the test picks, no Grafana. The project name is the test's
own, so a developer's `docker compose` project is never touched.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from llmgw import keys, procs
from llmgw.dev import servers

ROOT = Path(__file__).resolve().parents[2]
BUILD_IMAGES = ROOT / "deploy" / "local" / "build-images.sh"
FIGURES: list[str] = []  # timings and loop figures, printed at the end of the run


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("compose test figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def run(*argv: str, env: dict | None = None, timeout: float = 600) -> str:
    res = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )
    if res.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        )
    return res.stdout


@pytest.fixture(scope="session")
def docker_engine() -> None:
    why = None
    for argv, what in (
        (["docker", "info"], "no Docker engine answers (`docker info`)"),
        (["docker", "compose", "version"], "Docker Compose v2 is not installed"),
    ):
        try:
            ok = subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            why = f"{what}: as root, deploy/local/engine.sh installs and starts one"
            break
    if why:
        if os.environ.get("LLMGW_REQUIRE_COMPOSE") == "1":
            pytest.fail(f"{why}, and LLMGW_REQUIRE_COMPOSE=1", pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="session")
def images(docker_engine) -> dict[str, str]:
    """The LLMGW_*_IMAGE variables naming our own images, built (or reused) now."""
    started = time.monotonic()
    out = run("bash", str(BUILD_IMAGES), timeout=900)
    FIGURES.append(f"images: built in {time.monotonic() - started:.0f} s ({out.strip()[-300:]!r})")
    env = run("bash", str(BUILD_IMAGES), "compose-env")
    return dict(line.split("=", 1) for line in env.split())


class Compose:
    """One compose project of docker-compose.yml with the test's override on top."""

    def __init__(self, project: str, env: dict[str, str]):
        self.project = project
        self.env = env
        self.lb = f"http://127.0.0.1:{env['LLMGW_TEST_LB_PORT']}"
        self.api = f"http://127.0.0.1:{env['LLMGW_TEST_API_PORT']}"
        self.token = env["LLMGW_TEST_OPERATOR_TOKEN"]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        files = ("-f", "docker-compose.yml", "-f", "tests/deploy/compose.test.yml")
        return run(
            "docker", "compose", "-p", self.project, *files, *args, env=self.env, timeout=timeout
        )

    def up(self) -> float:
        """Seconds until every service is healthy and the one-shot jobs succeeded."""
        started = time.monotonic()
        self("up", "-d", "--no-build", "--pull", "never", timeout=300)
        # `up --wait` counts a one-shot job's exit, even with 0, as a failure: wait
        # for the long-running services' health, then for the jobs' exit codes.
        jobs = ("migrate", "apply")
        services = [s for s in self("config", "--services").split() if s not in jobs]
        self(
            "up",
            "-d",
            "--wait",
            "--no-deps",
            "--no-build",
            "--pull",
            "never",
            *services,
            timeout=300,
        )

        def states() -> list[str]:
            form = "{{.Service}} {{.State}} {{.ExitCode}}"
            return [s for s in self("ps", "--all", "--format", form, *jobs).split("\n") if s]

        def jobs_done() -> bool:
            return all(s.split()[1:] == ["exited", "0"] for s in states())

        assert procs.wait_until(jobs_done, 180, 1), f"one-shot jobs: {states()}"
        return time.monotonic() - started

    def container(self, service: str) -> str:
        return self("ps", "-q", "--all", service).strip()


@pytest.fixture(scope="module")
def compose(images, tmp_path_factory):
    token = keys.new_key()
    env = {
        **os.environ,
        **images,
        "LLMGW_TEST_LB_PORT": str(servers.free_port()),
        "LLMGW_TEST_API_PORT": str(servers.free_port()),
        "LLMGW_TEST_PROMETHEUS_PORT": str(servers.free_port()),
        "LLMGW_TEST_OPERATOR_TOKEN": token,
        "OPERATOR_TOKEN_HASH": keys.hash_key(token),
    }
    cluster = Compose(f"llmgw-test-{os.getpid()}", env)
    try:
        FIGURES.append(f"compose up: healthy in {cluster.up():.0f} s")
        yield cluster
    finally:
        logs = tmp_path_factory.mktemp("compose") / "compose.log"
        try:
            logs.write_text(cluster("logs", "--no-color", "--timestamps", timeout=120))
            FIGURES.append(f"compose logs: {logs}")
        except Exception as exc:  # the project may never have come up
            FIGURES.append(f"compose logs: none ({exc})"[:300])
        cluster("down", "--volumes", "--remove-orphans", timeout=300)
