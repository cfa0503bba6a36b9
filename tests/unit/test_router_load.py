"""Load signals parsed from engines' /metrics pages."""

from llmgw.router.endpoints.load import parse_metrics

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
"""


def test_vllm_counts_are_summed_and_kv_usage_is_the_fullest_cache():
    load = parse_metrics(VLLM, at=7.0)
    assert (load.waiting, load.running, load.kv_usage, load.at, load.source) == (
        4,
        5,
        0.5,
        7.0,
        "vllm",
    )


def test_older_vllm_falls_back_to_gpu_cache_usage_perc():
    text = b"vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.75\n"
    assert parse_metrics(text, 0).kv_usage == 0.75


def test_sglang_names():
    text = (
        b'sglang:num_running_reqs{model_name="m"} 6\n'
        b'sglang:num_queue_reqs{model_name="m"} 2\n'
        b'sglang:token_usage{model_name="m"} 0.4\n'
    )
    load = parse_metrics(text, 0)
    assert (load.waiting, load.running, load.kv_usage, load.source) == (2, 6, 0.4, "sglang")


def test_a_page_without_load_gauges_or_with_nan_gives_none():
    assert parse_metrics(b"process_cpu_seconds_total 3\n", 0) is None
    assert parse_metrics(b"vllm:num_requests_waiting NaN\n", 0) is None
    assert parse_metrics(b"", 0) is None
