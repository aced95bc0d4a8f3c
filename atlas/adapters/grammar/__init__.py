"""Grammar adapters: constraint specs compiled for a tokenizer (llguidance)."""
