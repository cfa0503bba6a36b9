"""What `llmgw dev` applies for real vLLM, and the try-it facts it prints for any catalog."""

import json

from llmgw import config, keys
from llmgw.agent.config import AgentConfig
from llmgw.dev import catalog as devcatalog
from llmgw.dev import cluster as devcluster

DEMO_KEYS = {"demo": "sk-llmgw-demo-1", "batch": "sk-llmgw-batch-2"}


def test_the_demo_catalog_prints_the_platinum_demo_key_and_its_first_model():
    t = devcatalog.try_it(devcluster.demo_catalog(DEMO_KEYS), DEMO_KEYS)
    assert t.models == {"demo-chat": 2, "demo-small": 1}
    assert t.model == "demo-chat" and t.api_key == "sk-llmgw-demo-1"
    assert "platinum" in t.key_note


def test_a_catalog_of_its_own_names_its_model_and_never_a_key_it_does_not_accept():
    own = {
        "models": [{"name": "off", "replicas": 0}, {"name": "llama", "profile": {"engine": "sim"}}],
        "tenants": [{"name": "acme", "band": "b", "key_hashes": [keys.hash_key("sk-acme")]}],
    }
    t = devcatalog.try_it(own, DEMO_KEYS)
    assert t.models == {"off": 0, "llama": 1}
    assert t.model == "llama"  # the first model that runs
    assert t.api_key is None and "acme" in t.key_note


def test_a_catalog_that_keeps_the_batch_key_prints_that_one():
    cat = devcluster.demo_catalog(DEMO_KEYS)
    cat["tenants"] = [t for t in cat["tenants"] if t["name"] == "batch"]
    assert devcatalog.try_it(cat, DEMO_KEYS).api_key == "sk-llmgw-batch-2"


def test_a_catalog_without_tenants_needs_no_key():
    t = devcatalog.try_it({"models": [{"name": "m"}]}, DEMO_KEYS)
    assert t.model == "m" and t.api_key is None and "no tenants" in t.key_note


def test_the_vllm_catalog_serves_the_tiny_model_with_cpu_settings_and_demo_tenants():
    demo = devcluster.demo_catalog(DEMO_KEYS)
    cat = devcatalog.vllm_catalog(demo, "/models/tiny")
    assert cat["tenants"] == demo["tenants"] and cat["bands"] == demo["bands"]
    [model] = cat["models"]
    p = model["profile"]
    assert model["name"] == "tiny-llama" and model["replicas"] == 2
    assert p["engine"] == "vllm" and p["model_ref"] == "/models/tiny"
    assert p["max_model_len"] == 1024 and "--enforce-eager" in p["engine_args"]
    assert devcatalog.try_it(cat, DEMO_KEYS).model == "tiny-llama"


def test_agents_run_vllm_as_a_module_of_the_given_python_and_keep_an_operators_cpu_setting():
    env = devcatalog.vllm_agent_env("/v/bin/python", {})
    assert json.loads(env["LLMGW_VLLM_COMMAND"]) == [
        "/v/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    # ... which the agent reads as its vllm_command.
    cfg = config.load(AgentConfig, env=env)
    assert cfg.vllm_command == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in devcatalog.vllm_agent_env(
        "/v/bin/python", {"VLLM_CPU_KVCACHE_SPACE": "4"}
    )
