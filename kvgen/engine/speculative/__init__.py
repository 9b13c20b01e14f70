"""Speculative decoding: a drafter proposes k tokens for a decoding sequence, the target model
checks all of them in the same forward pass as the rest of the batch (k+1 query positions over
the paged cache, like a prefill chunk), and the engine keeps the longest prefix the target
agrees with, plus one token of the target's own.

ngram.py        PromptLookup: propose what followed the sequence's last n-gram earlier in it
draft_model.py  DraftModel: a cheaper model with the target's vocabulary decodes k tokens ahead
eagle.py        Eagle: a one-layer head over the target's own hidden states drafts (EAGLE-1 layout)
verify.py       accept(): greedy prefix match, or rejection sampling (lossless in distribution)
policy.py       DraftLength: each sequence's adaptive k (the seeds' 0.8 / 0.4 thresholds) and
                the batch-size cap (speculation pays at low load only), when a drafter
                far behind a sequence is worth catching up, and DraftEconomy: whether a
                drafted token saves more target time than it costs (measured)
"""

from kvgen.engine.speculative.draft_model import DraftModel
from kvgen.engine.speculative.eagle import Eagle, load_head
from kvgen.engine.speculative.ngram import PromptLookup
from kvgen.engine.speculative.policy import DraftEconomy, DraftLength, draft_cap, worth_catching_up
from kvgen.engine.speculative.verify import accept

MODES = ("off", "ngram", "draft", "eagle")

__all__ = ["MODES", "DraftEconomy", "DraftLength", "DraftModel", "Eagle", "PromptLookup", "accept", "draft_cap",
           "load_head", "worth_catching_up"]
