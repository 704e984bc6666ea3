"""Resident memory of the plain quantized engine in-process, by stage: after importing torch,
transformers and specdec, after loading the preset, and after 1, 6 and 12 HumanEval prompts
(128 tokens, greedy), then every 12 more up to `--prompts`. The server adds its own
(Hypercorn, tokenizer threads) on top. The KV pool's pages are committed as its blocks are
first written, and finished prompts' blocks stay cached until the pool has no untouched block
left: `--prompts 48` reaches the steady state of a server that has run a while.
`--speculative` keeps the preset's default speculation (the draft model and its own pool).

    python bench/investigations/cpu_rss_inprocess.py [--prompts 48] [--speculative]
"""

import argparse
import sys
from pathlib import Path


def rss(tag: str) -> None:
    fields = {k: v.strip() for k, v in (line.split(":", 1) for line in open("/proc/self/status"))}
    print(f"{tag}: VmRSS {fields['VmRSS']} (anonymous {fields['RssAnon']}; file-backed "
          f"{fields['RssFile']}: libraries and the GGUF's embedding rows read so far; shared "
          f"{fields['RssShmem']}: the KV pools), VmHWM {fields['VmHWM']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--speculative", action="store_true")
    a = ap.parse_args()
    import torch  # noqa: F401

    rss("torch")
    import transformers  # noqa: F401

    rss("transformers")
    from specdec import LLM, SamplingParams

    rss("specdec import")
    llm = LLM(model="qwen2.5-coder-1.5b", quantization="auto",
              speculative=None if a.speculative else {"method": "none"})
    rss("loaded")
    kv = llm.engine.runner.kv
    print(f"kv cache {tuple(kv.shape)} {kv.dtype}: {kv.numel() * kv.element_size() / 1e6:.0f} MB "
          "reserved (pages are committed as blocks are used)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from prompts import humaneval_texts

    blocks = llm.engine.blocks
    print(f"cached prefixes keep at most {blocks.resident} blocks written "
          "(cpu_kv_resident_bytes) unless requests hold more at once")
    for i, p in enumerate(humaneval_texts(a.prompts)):
        llm.generate([p], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
        if i in (0, 5) or (i + 1) % 12 == 0:
            rss(f"after {i + 1} prompts ({len(blocks.free)} of {blocks.num_blocks} KV blocks "
                "never written or freed unhashed)")


if __name__ == "__main__":
    main()
