"""Atlas: an LLM inference server."""
