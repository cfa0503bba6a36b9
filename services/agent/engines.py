"""Which engines this node can run, found once at agent start.

An engine counts as installed when its executable resolves and, for the Python
engines, its module is importable by the Python that will run it. Installing an
engine while an agent runs takes an agent restart to be noticed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from llmgw.engines import ENGINES

from .config import AgentConfig

_FIND_SPEC = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"


def _module_missing(python: str, module: str) -> str | None:
    # Compare the paths as given, never resolved: every virtual environment's python is a
    # link to the same interpreter, and which environment it runs is where the link lives.
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
    else:
        try:
            res = subprocess.run(
                [python, "-c", _FIND_SPEC, module], capture_output=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot run {python}: {exc}"
        found = res.returncode == 0
    return None if found else f"Python module {module} is not importable by {python}"


def missing(command: list[str], module: str | None) -> str | None:
    """None when `command` can run, else why not."""
    if not command:
        return "no command configured"
    exe = shutil.which(command[0])
    if exe is None:
        return f"{command[0]} not found (not on PATH or not executable)"
    if module is None:
        return None
    return _module_missing(exe, module)


def detect(cfg: AgentConfig) -> dict[str, str | None]:
    """Engine name -> None when installed, else the reason it is not."""
    return {name: missing(cmd, _module(name, cmd)) for name, cmd in cfg.engine_commands().items()}


def _module(engine: str, command: list[str]) -> str | None:
    # vLLM run as `python -m ...` (its environment's Python, not the console script):
    # the Python resolving proves nothing, the package must be importable by it.
    if engine == "vllm" and "-m" in command:
        return "vllm"
    return ENGINES[engine].installed_module
