"""What the example's offline cache holds, shared by the producer and the trainer.

One cache row per sample, right-padded to ``max_len`` tokens:

==================  ===============  =========================================
key                 dtype, shape     meaning
==================  ===============  =========================================
``input_ids``       int64 ``[L]``    tokens (0 on padding)
``seq_len``         int64 ``[]``     real length
``loss_mask``       bool ``[L]``     supervised tokens (the prompt is masked
                                     when ``mask_prompt``)
``topk_logprobs``   float32 ``[L,K]``  target's top-k next-token log-probs
``topk_indices``    int32 ``[L,K]``    their vocabulary ids
``hidden``          bf16 ``[L,H]``     target's final hidden states
==================  ===============  =========================================

The manifest records the producer options below; the trainer refuses a cache
whose options differ from its own (``ensure_supervision_options_match``),
including the packing it was produced for: ``cp_size`` fixes the pad multiple
``2*cp`` of every document, and the producer checked that every sample fits a
packed row of ``pack_seq_len`` slots at that multiple.
"""

from __future__ import annotations

CACHE_NAME = "ep_cp_distill"
FORMAT_VERSION = 1
PRODUCER = "examples/precompute_cache.py"
KEYS = ("input_ids", "seq_len", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
#: per-token supervision the trainer packs alongside the ids
TOKEN_KEYS = ("loss_mask", "topk_logprobs", "topk_indices", "hidden")
#: options that change the stored supervision or the packing it was validated for
CHECKED_OPTIONS = ("mask_prompt", "topk", "cp_size", "pad_to_multiple_of", "pack_seq_len")
