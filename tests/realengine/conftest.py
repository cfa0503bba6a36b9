"""Real vLLM for the `real_engine` tests: its environment, a tiny model, one engine.

vLLM never lives in llmgw's environment: LLMGW_VLLM_PYTHON names the Python of an
environment that has it (`.ci/run` makes one). Without it these tests skip, unless
LLMGW_REQUIRE_REAL_ENGINE=1 (CI), where a missing vLLM is a failure. They are
deselected from the default run (`-m "not real_engine"` in pyproject) and run with
`pytest -m real_engine`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmgw.dev import tinymodel
from tests.realengine import kit


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("LLMGW_VLLM_PYTHON", "")
    why = None
    if not python:
        why = "LLMGW_VLLM_PYTHON is not set (the Python of an environment with vLLM)"
    else:
        res = subprocess.run(
            [python, "-c", "import importlib.util as u; assert u.find_spec('vllm')"],
            capture_output=True,
            timeout=120,
        )
        if res.returncode != 0:
            why = f"LLMGW_VLLM_PYTHON={python} cannot import vllm"
    if why:
        if os.environ.get("LLMGW_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(f"{why}, and LLMGW_REQUIRE_REAL_ENGINE=1", pytrace=False)
        pytest.skip(why)
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory) -> Path:
    return tinymodel.ensure(vllm_python, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def vllm_engine(vllm_python, tiny_model, tmp_path_factory):
    """One real vLLM, launched with the command line the agent's adapter writes."""
    # A long context, so a stream of thousands of tokens outlasts what a test does meanwhile.
    engine = kit.start_vllm(
        vllm_python, tiny_model, tmp_path_factory.mktemp("vllm"), max_model_len=8192
    )
    try:
        yield engine
    finally:
        engine.stop()
