"""Resident memory of the plain quantized engine in-process, by stage: after importing torch,
transformers and specdec, after loading the preset, and after 1, 6 and 12 HumanEval prompts
(128 tokens, greedy). The server adds its own (Hypercorn, tokenizer threads) on top.

    python bench/investigations/cpu_rss_inprocess.py
"""

import sys
from pathlib import Path


def rss(tag: str) -> None:
    fields = {k: v.strip() for k, v in (line.split(":", 1) for line in open("/proc/self/status"))}
    print(f"{tag}: VmRSS {fields['VmRSS']}, VmHWM {fields['VmHWM']}", flush=True)


def main() -> None:
    import torch  # noqa: F401

    rss("torch")
    import transformers  # noqa: F401

    rss("transformers")
    from specdec import LLM, SamplingParams

    rss("specdec import")
    llm = LLM(model="qwen2.5-coder-1.5b", quantization="auto", speculative={"method": "none"})
    rss("loaded")
    kv = llm.engine.runner.kv
    print(f"kv cache {tuple(kv.shape)} {kv.dtype}: {kv.numel() * kv.element_size() / 1e6:.0f} MB "
          "reserved (pages are committed as blocks are used)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from prompts import humaneval_texts

    for i, p in enumerate(humaneval_texts(12)):
        llm.generate([p], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
        if i in (0, 5, 11):
            rss(f"after {i + 1} prompts")


if __name__ == "__main__":
    main()
