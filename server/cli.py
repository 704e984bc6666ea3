"""`specdec serve`: build the engine, then serve it with Hypercorn until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from typing import Any

from server.app import build_app
from server.async_engine import AsyncEngine

log = logging.getLogger("specdec.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec serve",
                                description="OpenAI-compatible server with speculative decoding")
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="preset name, HF-style directory or .gguf file")
    p.add_argument("--served-model-name", default=None, help="model id clients must send")
    p.add_argument("--draft-model", default=None, help="draft model for --speculative draft_model")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft_model", "none"],
                   help="default drafter (default: the engine's choice)")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued beyond this are answered 429 (default: engine config)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLMEngine.from_args keyword (value parsed as int/float if it can)")
    p.add_argument("--no-adaptive-speculation", action="store_true",
                   help="keep every request's draft length fixed instead of letting the engine "
                        "shrink it (down to plain decoding) when measured costs say it does "
                        "not pay")
    p.add_argument("--no-overlap", action="store_true",
                   help="read every step back before launching the next (by default on CUDA "
                        "the next step is launched first, so the host's work overlaps the GPU's)")
    p.add_argument("--no-spec-overlap", action="store_true",
                   help="draft every speculative step on the host between steps (by default, "
                        "with overlap, drafters with position tables, the replay drafter, draft "
                        "on the device and each step is launched before the last is read back)")
    p.add_argument("--log-level", default="info")
    return p


def speculative_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    method = args.speculative or ("draft_model" if args.draft_model else None)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise SystemExit("--num-speculative-tokens needs --speculative")
        return None  # the engine's default
    spec: dict[str, Any] = {"method": method}
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.draft_model:
        spec["draft_model"] = args.draft_model
    return spec


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": args.model, "speculative": speculative_from_args(args),
                          "adaptive_speculation": not args.no_adaptive_speculation}
    if args.no_overlap:
        kw["overlap"] = False
    if args.no_spec_overlap:
        kw["spec_overlap"] = False
    for name in ("dtype", "device", "max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        kw[key.replace("-", "_")] = _parse_value(value)
    return kw


async def _serve(aengine: AsyncEngine, args: argparse.Namespace) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    app = build_app(aengine, api_key=args.api_key, model_name=args.served_model_name)
    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    logging.getLogger("hypercorn.error").propagate = False  # it has its own handler
    config.graceful_timeout = 5.0  # connections are idle by then: the engine drained first
    stop = asyncio.Event()
    drained: list[asyncio.Task[None]] = []

    async def drain() -> None:
        log.info("shutting down: finishing in-flight requests (grace %.0fs)",
                 args.shutdown_grace)
        await aengine.shutdown(args.shutdown_grace)
        stop.set()

    def on_signal() -> None:
        if drained:  # a second signal: stop now
            stop.set()
            return
        drained.append(asyncio.ensure_future(drain()))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    log.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specdec.engine import LLMEngine

    engine = LLMEngine.from_args(**engine_kwargs(args))
    if engine.runner.graphs is not None:
        t0 = time.monotonic()
        n = engine.runner.graphs.capture_all(engine.config.scheduler.max_num_seqs, 16)
        log.info("captured %d CUDA graphs in %.1f s", n, time.monotonic() - t0)
    aengine = AsyncEngine(engine, max_waiting=args.max_waiting)
    asyncio.run(_serve(aengine, args))
    return 0
