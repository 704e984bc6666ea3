"""The PyTorch attention backend.

The step's metadata and the KV cache layout are specdec/attention_metadata.py's. The attention
and the KV write this backend runs are the kernels' references (verify_kernels/reference.py),
one implementation for the CPU engine and for the tests that hold the kernels to it.
"""

from __future__ import annotations

import torch

from specdec.attention_metadata import AttentionMetadata
from verify_kernels.reference import paged_attention_ref, write_kv_ref


class TorchAttentionBackend:
    """The CPU/reference backend. A Triton backend offers the same two calls."""

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
