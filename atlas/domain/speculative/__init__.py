"""Speculative decoding: propose drafts, verify them in one target forward, keep what passes.

`config` parses `--speculative-config`; `ngram` proposes from the sequence's own tokens;
`verify` holds the acceptance rules and their random-stream contract; `outcome` the results the
scheduler applies and the counters the metrics report. docs/lab/speculative-plan.md says how
scheduler, worker, sampler and caches take them up.
"""

from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeConfigError, SpeculativeMethod
from atlas.domain.speculative.ngram import NgramIndex, NgramProposer
from atlas.domain.speculative.outcome import SpecDecodeStats, VerifyOutcome, VerifyResult
from atlas.domain.speculative.verify import accept_matching, draft_seeds, race, rejection_sample

__all__ = [
    "NgramIndex",
    "NgramProposer",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeMethod",
    "VerifyOutcome",
    "VerifyResult",
    "accept_matching",
    "draft_seeds",
    "race",
    "rejection_sample",
]
