"""Triton kernels of the verification step: paged attention, KV writes and compaction, and
on-device tree acceptance. Each sits behind a checked launcher beside its PyTorch reference."""

from verify_kernels.acceptance import accept_tree
from verify_kernels.kv_ops import compact_kv, compact_kv_ref, write_kv
from verify_kernels.paged_attention import choose_num_splits, paged_attention

__all__ = [
    "accept_tree",
    "choose_num_splits",
    "compact_kv",
    "compact_kv_ref",
    "paged_attention",
    "write_kv",
]
