"""llmgw.simengine: a vLLM-compatible engine simulator for tests and benchmarks."""
