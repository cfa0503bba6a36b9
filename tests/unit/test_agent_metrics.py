"""Load from engine /metrics pages: vLLM (current and pre-0.11 names) and SGLang."""

from llmgw.agent.metrics import Load, parse_load

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",model_name="llama",num_gpu_blocks="4096"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 12.0
vllm:num_requests_running_fake_suffix{engine="0"} 99
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_vllm_current_names():
    assert parse_load(VLLM) == Load(
        running=3, waiting=7, kv_usage=0.42, block_size=16, num_blocks=4096
    )


def test_vllm_pre_0_11_kv_name_is_the_fallback():
    old = VLLM.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_load(old).kv_usage == 0.42
    both = VLLM + 'vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.9\n'
    assert parse_load(both).kv_usage == 0.42  # the current name wins


def test_data_parallel_engines_add_up_and_kv_takes_the_worst():
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 5
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1
"""
    assert parse_load(text) == Load(
        running=7, waiting=1, kv_usage=0.7, block_size=32, num_blocks=200
    )


def test_sglang_names():
    text = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 4.0
sglang:num_queue_reqs{model_name="qwen"} 2.0
sglang:token_usage{model_name="qwen"} 0.31
sglang:cache_hit_rate{model_name="qwen"} 0.5
"""
    assert parse_load(text) == Load(running=4, waiting=2, kv_usage=0.31)


def test_a_page_without_engine_gauges_gives_nothing():
    assert parse_load("python_info 1\n# TYPE vllm:foo gauge\n") is None
    assert parse_load("") is None


def test_nan_and_garbage_values_are_skipped():
    text = 'vllm:num_requests_running NaN\nvllm:num_requests_waiting{a="b"} x\nvllm:kv_cache_usage_perc 0.5\n'
    assert parse_load(text) == Load(running=0, waiting=0, kv_usage=0.5)


# As vLLM 0.32 (--enable-lora) writes it: one series per label set ever reported, the value
# the time it was last set; the newest is the present.
LORA_INFO = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters="a1"} 1.7963784909512928e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7963784909568698e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a2,a3",waiting_lora_adapters="a4"} 1.7963785481798503e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a5",waiting_lora_adapters=""} 1.7963785477713785e+09
"""


def test_the_newest_lora_requests_info_series_gives_running_and_waiting_adapters():
    load = parse_load(VLLM + LORA_INFO)
    assert load.running_adapters == ("a2", "a3") and load.waiting_adapters == ("a4",)
    assert load.running == 3  # the rest of the page is read as before


def test_an_idle_newest_series_means_no_adapters():
    page = LORA_INFO.replace("1.7963785481798503e+09", "1.0").replace(
        "1.7963785477713785e+09", "2.0"
    )
    load = parse_load(VLLM + page)
    assert load.running_adapters == () and load.waiting_adapters == ()
