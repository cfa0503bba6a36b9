"""llmgw: one OpenAI-compatible endpoint in front of a fleet of LLM engines."""

__version__ = "0.1.0"
