"""graphcap backend plugin for Huawei Ascend NPUs (torch_npu ACL graphs).

Importing this package never imports torch_npu, so it cannot fail or end the process on a
machine without CANN; the backend then reports itself unavailable, with the reason.
"""

from graphcap_npu.attention import (
    ATTENTION_NAME,
    BLOCKS,
    FA3_BNSD,
    FA3_BSH,
    FIAS_BNSD,
    FIAS_BSH,
    IMPLEMENTATIONS,
    block_attention_forward,
    fusion_attention_forward,
    register_attention,
)
from graphcap_npu.backend import ATTENTION_VAR, NPUBackend, npu_availability

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_VAR",
    "BLOCKS",
    "FA3_BNSD",
    "FA3_BSH",
    "FIAS_BNSD",
    "FIAS_BSH",
    "IMPLEMENTATIONS",
    "NPUBackend",
    "block_attention_forward",
    "fusion_attention_forward",
    "npu_availability",
    "register_attention",
]
