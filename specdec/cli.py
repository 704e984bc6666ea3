"""The `specdec` command: generate, pull, serve, train-drafter, ab."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from specdec.cli_options import HelpFormatter, add_weight_args, runtime_from_env


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specdec generate",
                                description="Complete a prompt, streaming tokens as they come",
                                formatter_class=HelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_weight_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--speculative", default=None,
                   help="'none', 'ngram', 'draft_model' or a JSON dict such as "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 6}'")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--stats", action="store_true", help="print speculation metrics at the end")
    p.add_argument("--no-adaptive-speculation", action="store_true",
                   help="keep the draft length fixed even where it does not pay")
    a = p.parse_args(argv)

    from specdec import LLM, SamplingParams

    t0 = time.monotonic()
    _note(f"loading {a.model} ...")
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, speculative=_spec(a),
              adaptive_speculation=not a.no_adaptive_speculation, quantization=a.quantization,
              cpu_kernel=a.cpu_kernel, runtime=runtime_from_env())
    spec = llm.engine.default_spec
    if spec.method != "none":
        _note(f"loading the {spec.method} drafter"
              + (f" ({spec.draft_model})" if spec.draft_model else "") + " ...")
        llm.engine.load_default_drafter()
    _note(f"ready in {time.monotonic() - t0:.1f} s")
    prompt: Any = a.prompt
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": a.prompt}], add_generation_prompt=True, tokenize=False)
    params = SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty, max_tokens=a.max_tokens, seed=a.seed,
        stop=tuple(a.stop))
    last = None
    for out in llm.stream([prompt], params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if a.stats and last is not None:
        spec = last.spec.to_dict() if last.spec else None
        print(json.dumps({"finish_reason": last.finish_reason,
                          "completion_tokens": len(last.token_ids), "speculative": spec}),
              file=sys.stderr)
    return 0


def _note(text: str) -> None:
    print(f"specdec: {text}", file=sys.stderr, flush=True)


def _spec(a: argparse.Namespace) -> dict[str, Any] | None:
    if a.speculative is None and a.draft_model is None:
        return None
    spec: dict[str, Any]
    if a.speculative and a.speculative.strip().startswith("{"):
        spec = json.loads(a.speculative)
    else:
        spec = {"method": a.speculative or "draft_model"}
    if a.draft_model:
        spec["draft_model"] = a.draft_model
    if a.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = a.num_speculative_tokens
    return spec


def _pull(argv: list[str]) -> int:
    from specdec.hub import PRESETS, pull

    p = argparse.ArgumentParser(prog="specdec pull", description="Install a preset model",
                                formatter_class=HelpFormatter)
    p.add_argument("name", choices=sorted(PRESETS))
    a = p.parse_args(argv)
    print(pull(a.name, progress=True))
    return 0


def _serve(argv: list[str]) -> int:
    from server.cli import serve_main

    return serve_main(argv) or 0


def _train(argv: list[str]) -> int:
    from specdec.train_drafter import main as train_main

    return train_main(argv)


def _ab(argv: list[str]) -> int:
    from experiments.cli import main as ab_main

    return ab_main(argv)


COMMANDS = {"generate": _generate, "pull": _pull, "serve": _serve, "train-drafter": _train,
            "ab": _ab}


USAGE = ("usage: specdec {generate,pull,serve,train-drafter,ab} ...\n"
         "  generate [--model M] PROMPT   complete a prompt (streams)\n"
         "  pull NAME                     install a preset model\n"
         "  serve [--model M] ...         OpenAI-compatible HTTP server\n"
         "  train-drafter --target M ...  train an EAGLE head\n"
         "  ab {export,report,run} ...    A/B experiments between drafters\n"
         "`specdec COMMAND --help` lists a command's options and their defaults.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
