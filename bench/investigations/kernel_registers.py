"""Registers and stack per thread of the attention kernels compiled for a GPU architecture, on
a machine without one (Triton's wheel brings ptxas and cuobjdump). A program that needs more
than 65536 / (32 x warps) registers stops two programs from sharing an SM, and a stack means
spills (or libdevice's slow-path sin/cos).

The H200 runs Triton 3.6: for its counts, install `triton==3.6.0` into a separate venv and put
its site-packages first on PYTHONPATH (the kernels need only its compiler):

    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:. \\
        python3 bench/investigations/kernel_registers.py

With Triton 3.6: tree attention at 8 rows of 4 heads (32 rows a program, 8 warps) takes 247
registers and no stack as built (4eaf325); at 8ff3e1d, whose owner issued all its loads first,
255 and a 496-byte stack (its file imports `register_cap` from verify_kernels.pdl, since
moved: replace that import with a stub); at 6cd4cd0, computing its rotary angles in the
kernel, 226 and 32.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Integer arguments that may not be multiples of 16 (the others are, as at launch: Triton
# specialises on divisibility by 16, which lets loads vectorise).
_ODD = {"q_len", "stride_lh", "stride_lb", "stride_bt", "scale_log2", "rope_scaling"}
_TYPES = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "inv_ptr": "*fp32", "rope_ptr": "*fp32",
          "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "pos_ptr": "*i64",
          "slot_ptr": "*i64", "mask_offsets_ptr": "*i64", "custom_mask_ptr": "*u8",
          "scale_log2": "fp32", "rope_scaling": "fp32"}


def resources(kernel, constexprs: dict, num_warps: int, arch: int = 90) -> str:
    """'REG n STACK m' of `kernel` compiled with `constexprs` for sm_`arch`."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n], cx[(i,)] = "constexpr", constexprs[n]
            continue
        sig[n] = _TYPES.get(n, "*bf16" if n.endswith("_ptr") else "i32")
        if n not in _ODD:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, cx, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"REG {m.group(1)} STACK {m.group(2)}" if m else out.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--tree-source", default=None,
                    help="another version of verify_kernels/tree_attention.py (say, "
                         "`git show REV:verify_kernels/tree_attention.py > FILE`)")
    args = ap.parse_args()
    from verify_kernels.decode_attention import _decode_attn_kernel
    from verify_kernels.tree_attention import _tree_attn_kernel

    if args.tree_source:
        spec = importlib.util.spec_from_file_location("tree_source", args.tree_source)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _tree_attn_kernel = mod._tree_attn_kernel

    print(f"Triton {triton.__version__}, sm_{args.arch}, head dim 128, 16-token blocks")
    for rows, group, bm, splits, bn, warps in ((8, 4, 32, 9, 64, 8), (2, 4, 16, 9, 64, 8),
                                               (8, 7, 32, 9, 64, 8), (16, 4, 32, 9, 64, 8)):
        cx = dict(HEAD_DIM=128, GROUP=group, GROUP_P=1 << (group - 1).bit_length(),
                  BLOCK_M=bm, NEW_P=max(16, rows), BLOCK_N=bn, BLOCK_SIZE=16,
                  NUM_SPLITS=splits, HAS_MASK=True,
                  ROW_BLOCKS=max(1, rows * (1 << (group - 1).bit_length()) // bm),
                  DOT_PRECISION=None)
        print(f"tree attention, {rows} rows x {group} heads a KV head, {bm} rows a program, "
              f"{splits} splits, {bn}-column tiles, {warps} warps: "
              + resources(_tree_attn_kernel, cx, warps, args.arch))
    for splits, bn, warps in ((32, 32, 4), (16, 32, 4)):
        cx = dict(HEAD_DIM=128, GROUP=4, BLOCK_M=16, BLOCK_N=bn, BLOCK_SIZE=16,
                  NUM_SPLITS=splits, DOT_PRECISION=None, USE_PDL=False)
        print(f"decode attention, 4 heads a KV head, {splits} splits, {bn}-column tiles, "
              f"{warps} warps: " + resources(_decode_attn_kernel, cx, warps, args.arch))


if __name__ == "__main__":
    main()
