"""llmgw.router: the stateless OpenAI-compatible data plane."""
