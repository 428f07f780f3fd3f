"""Speculative decoding: cheap draft tokens checked by the target model in one forward.

``config`` holds the user's ``speculative_config``; ``ngram`` proposes drafts by prompt
lookup (the scheduler calls it once per step for each decoding request); ``verify`` turns
the target model's samples at the draft positions into the accepted tokens.
"""
from halserve.spec_decode.config import SpeculativeConfig
from halserve.spec_decode.ngram import NgramProposer
from halserve.spec_decode.verify import count_accepted

__all__ = ["NgramProposer", "SpeculativeConfig", "count_accepted"]
