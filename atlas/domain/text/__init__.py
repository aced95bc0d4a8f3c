"""Text on the way out: incremental detokenizing and stop strings."""

from atlas.domain.text.detokenizer import IncrementalDetokenizer
from atlas.domain.text.stop_strings import StopMatch, StopStringMatcher

__all__ = ["IncrementalDetokenizer", "StopMatch", "StopStringMatcher"]
