"""Ports: the interfaces the domain talks through. Adapters implement them."""
