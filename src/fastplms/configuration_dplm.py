"""DPLM configuration (runtime module: ships inside every DPLM artifact).

DPLM's network is ESM2's, so its config is ESM2's under its own model type; generation reads the
special ids from it (`<mask>` 32, `<pad>` 1, `<cls>` 0, `<eos>` 2, `X` 24: the official tokenizer's).
"""

from __future__ import annotations

from .configuration_esm2 import ESM2Config


class DPLMConfig(ESM2Config):
    model_type = "fastplms_dplm"

    def __init__(self, x_token_id: int = 24, family: str = "DPLM", **kwargs) -> None:
        super().__init__(family=family, **kwargs)
        self.x_token_id = x_token_id
