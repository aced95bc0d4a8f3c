"""The five chat prompts the SmolLM2 checks run (mock against transformers, CUDA against the mock)."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three colours of the rainbow.",
    "How do I boil an egg?",
]
