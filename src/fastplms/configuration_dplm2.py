"""DPLM2 configuration (runtime module: ships inside every DPLM2 artifact).

DPLM's config with DPLM2's 8,229-token vocabulary (`tokenization_dplm2`): amino-acid specials at ESM's
ids (`<cls_aa>` 0, `<pad>` 1, `<eos_aa>` 2, `<mask_aa>` 32), the structure track's `<cls_struct>` 33,
`<eos_struct>` 34, `<mask_struct>` 8228, and an untied LM decoder.
"""

from __future__ import annotations

from .configuration_dplm import DPLMConfig
from .tokenization_dplm2 import STRUCT_CLS_ID, STRUCT_EOS_ID, STRUCT_MASK_ID, VOCAB_SIZE


class DPLM2Config(DPLMConfig):
    model_type = "fastplms_dplm2"

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        struct_cls_token_id: int = STRUCT_CLS_ID,
        struct_eos_token_id: int = STRUCT_EOS_ID,
        struct_mask_token_id: int = STRUCT_MASK_ID,
        family: str = "DPLM2",
        **kwargs,
    ) -> None:
        super().__init__(vocab_size=vocab_size, family=family, **kwargs)
        self.struct_cls_token_id = struct_cls_token_id
        self.struct_eos_token_id = struct_eos_token_id
        self.struct_mask_token_id = struct_mask_token_id
