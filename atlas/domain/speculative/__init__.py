"""Speculative decoding: propose drafts, verify them in one target forward, keep what passes.

`config` parses `--speculative-config`; `ngram` proposes from the sequence's own tokens,
`draft_model` with a small model run on the target's backend, `draft_head` with a head fed the
target's hidden states (MTP, EAGLE-3);
`policy` is what the scheduler asks (whether to speculate this step, and which drafts);
`verify` holds the acceptance rules and their random-stream contract; `outcome` the results the
scheduler applies and the counters the metrics report.
"""

from atlas.domain.speculative.config import SpeculativeConfig, SpeculativeConfigError, SpeculativeMethod
from atlas.domain.speculative.draft_head import DraftHeadProposer, HeadRunner
from atlas.domain.speculative.draft_model import DraftModelProposer, DraftRequest, StepRunner
from atlas.domain.speculative.ngram import NgramIndex, NgramProposer
from atlas.domain.speculative.outcome import SpecDecodeStats, VerifyOutcome, VerifyResult
from atlas.domain.speculative.policy import (
    DraftHeadSpeculation,
    DraftModelSpeculation,
    NgramSpeculation,
    NoSpeculation,
    SpeculationPolicy,
    speculation_policy,
)
from atlas.domain.speculative.verify import accept_matching, draft_seeds, race, rejection_sample, verify_drafts

__all__ = [
    "DraftHeadProposer",
    "DraftHeadSpeculation",
    "DraftModelProposer",
    "DraftModelSpeculation",
    "DraftRequest",
    "HeadRunner",
    "StepRunner",
    "NgramIndex",
    "NgramProposer",
    "NgramSpeculation",
    "NoSpeculation",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculationPolicy",
    "SpeculativeMethod",
    "VerifyOutcome",
    "VerifyResult",
    "accept_matching",
    "draft_seeds",
    "race",
    "rejection_sample",
    "speculation_policy",
    "verify_drafts",
]
