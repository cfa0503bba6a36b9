"""llmgw.agent: the node agent that registers GPUs and supervises engines."""
