"""Which engines an agent reports as installed, for vLLM run as a Python module."""

import subprocess
import sys

from llmgw.agent import engines
from llmgw.agent.config import AgentConfig

API_SERVER = "vllm.entrypoints.openai.api_server"


def test_vllm_as_a_module_counts_only_where_that_python_imports_vllm():
    # llmgw's own environment never has vLLM: a Python that resolves is not enough.
    cfg = AgentConfig(vllm_command=[sys.executable, "-m", API_SERVER])
    reason = engines.detect(cfg)["vllm"]
    assert reason and "vllm is not importable" in reason and sys.executable in reason


def test_vllm_console_script_counts_when_it_resolves():
    assert engines.detect(AgentConfig(vllm_command=["/nonexistent/vllm"]))["vllm"]
    assert engines.detect(AgentConfig(vllm_command=[sys.executable]))["vllm"] is None


def test_another_virtual_environment_is_asked_even_though_it_links_to_our_interpreter(tmp_path):
    # A fresh venv's python resolves to the same binary as ours, but has no llmgw.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    other = str(tmp_path / "v" / "bin" / "python")
    assert engines.missing([other, "-m", "llmgw.cli"], "llmgw") == (
        f"Python module llmgw is not importable by {other}"
    )
    assert engines.missing([sys.executable, "-m", "llmgw.cli"], "llmgw") is None
