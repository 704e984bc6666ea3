"""Triton kernels of the verification step: paged attention, KV writes and compaction, and
on-device tree acceptance. Each sits behind a checked launcher beside its PyTorch reference;
the references the engine runs as well (attention, KV writes, tree verification) are in
`verify_kernels.reference`.

The package itself imports nothing: the CPU path loads `verify_kernels.reference`, which needs
no Triton. Kernels are imported from their modules (`verify_kernels.paged_attention`,
`verify_kernels.acceptance`, ...).
"""
