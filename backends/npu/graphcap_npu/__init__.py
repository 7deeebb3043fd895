"""graphcap backend plugin for Huawei Ascend NPUs (torch_npu ACL graphs).

Importing this package never imports torch_npu, so it cannot fail or end the process on a
machine without CANN; the backend then reports itself unavailable, with the reason.
"""

from graphcap_npu.attention import ATTENTION_NAME, fusion_attention_forward, register_attention
from graphcap_npu.backend import NPUBackend, npu_availability
from graphcap_npu.kv_table import GrowableKVTable

__all__ = [
    "ATTENTION_NAME",
    "GrowableKVTable",
    "NPUBackend",
    "fusion_attention_forward",
    "npu_availability",
    "register_attention",
]
