"""`specdec serve`: build the engine, then serve it with Hypercorn until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from server.app import build_app
from server.async_engine import AsyncEngine
from server.experiment_runs import open_experiments
from server.limits import BODY_TIMEOUT_S
from server.loading import LoadingApp, Progress

log = logging.getLogger("specdec.server")


def build_parser() -> argparse.ArgumentParser:
    from specdec.cli_options import HelpFormatter, add_weight_args

    p = argparse.ArgumentParser(prog="specdec serve",
                                description="OpenAI-compatible server with speculative decoding",
                                formatter_class=HelpFormatter)
    add_weight_args(p)
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="preset name, HF-style directory or .gguf file")
    p.add_argument("--served-model-name", default=None, help="model id clients must send")
    p.add_argument("--draft-model", default=None, help="draft model for --speculative draft_model")
    p.add_argument("--speculative", default=None, choices=["auto", "ngram", "draft_model", "none"],
                   help="default drafter (default: the engine's choice)")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--allowed-hosts", default=None, metavar="HOST,...",
                   help="Host header values to answer ('*': any); default: on a loopback "
                        "--host, localhost, 127.0.0.1 and [::1] only; else any")
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                   help="origins whose web pages may call the server (CORS preflights "
                        "answered, e.g. https://app.example); default: none")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a request body not received within this is answered 408")
    p.add_argument("--max-concurrent-per-client", type=int, default=None, metavar="N",
                   help="requests one API key (without --api-key: one client address) may "
                        "have in flight; more are answered 429 (default: no limit)")
    p.add_argument("--draft-models", default="", metavar="NAME=MODEL,...",
                   help="draft models requests may name in speculative.draft_model, besides "
                        "the default one (a preset, directory or GGUF each; loaded on first use)")
    p.add_argument("--eagle-heads", default="", metavar="NAME=DIR,...",
                   help="EAGLE heads requests may name in speculative.eagle_head")
    p.add_argument("--infill-speculative", default="ngram",
                   choices=["default", "auto", "ngram", "draft_model", "none"],
                   help="speculation for /infill requests that do not choose one; 'default': "
                        "the server's, as for every other request (n-gram lookup over the "
                        "prompt won on bench/fim_eval.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--experiments", default=None, metavar="FILE",
                   help="A/B experiments between speculative configurations (YAML or JSON; "
                        "README: A/B experiments)")
    p.add_argument("--experiments-db", default=None, metavar="FILE",
                   help="SQLite file of experiment definitions and records (default: "
                        "experiments.sqlite in the model cache)")
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


LOOPBACK = ("localhost", "127.0.0.1", "[::1]", "::1")


def allowed_hosts_from_args(args: argparse.Namespace) -> list[str] | None:
    if args.allowed_hosts is not None:
        return [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if args.host in LOOPBACK or args.host.startswith("127."):
        return [*LOOPBACK, args.host]
    return None


def split_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def named(value: str, flag: str) -> dict[str, str]:
    """NAME=MODEL,... as a dict (`--draft-models`, `--eagle-heads`)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        name, sep, model = item.partition("=")
        if not sep or not name or not model:
            raise SystemExit(f"{flag} takes NAME=MODEL,...; got {item!r}")
        out[name] = model
    return out


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
    """LLMEngine.from_args keywords; the runtime switches from the flags and the SPECDEC_*
    environment variables (specdec.cli_options.runtime_from_env)."""
    from specdec.cli_options import runtime_from_env

    flags = {"overlap": False} if args.no_overlap else {}
    if args.no_spec_overlap:
        flags["spec_overlap"] = False
    kw: dict[str, Any] = {"model": args.model, "speculative": speculative_from_args(args),
                          "adaptive_speculation": not args.no_adaptive_speculation,
                          "runtime": runtime_from_env(**flags)}
    kw["quantization"], kw["cpu_kernel"] = args.quantization, args.cpu_kernel
    for name in ("dtype", "device", "max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        kw[key.replace("-", "_")] = _parse_value(value)
    return kw


def _load(args: argparse.Namespace, progress: Progress) -> Any:
    """Everything the default configuration uses, pulled and loaded before the server says it
    is ready: the target, the default drafter's model, and one short warm-up generation (it
    compiles and chooses the CPU kernels, or captures the CUDA graphs)."""
    from specdec.engine import LLMEngine
    from specdec.hub import PRESETS, default_draft_for, pull

    kw = engine_kwargs(args)
    spec = kw.get("speculative")
    draft = (spec or {}).get("draft_model") if spec else default_draft_for(args.model)
    for name in (args.model, draft):
        if name in PRESETS:
            progress.enter(f"pulling {name} (download and prepare once, then cached)")
            pull(name, progress=False)
    progress.enter(f"loading {args.model}")
    t0 = time.monotonic()
    engine = LLMEngine.from_args(**kw)
    log.info("loaded %s in %.1f s", args.model, time.monotonic() - t0)
    if engine.default_spec.method != "none":
        progress.enter(f"loading the {engine.default_spec.method} drafter"
                       + (f" ({engine.default_spec.draft_model})"
                          if engine.default_spec.draft_model else ""))
        engine.load_default_drafter()
    if engine.runner.graphs is not None:
        progress.enter("capturing CUDA graphs")
        t0 = time.monotonic()
        n = engine.runner.graphs.capture_all(engine.config.scheduler.max_num_seqs, 16)
        log.info("captured %d CUDA graphs in %.1f s", n, time.monotonic() - t0)
    if engine.plans_speculation:
        progress.enter("measuring step costs (once per machine, then cached)")
        t0 = time.monotonic()
        engine.calibrate_costs()
        log.info("step costs measured in %.1f s", time.monotonic() - t0)
    progress.enter("warming up")
    engine.warm_up()
    if engine.runner.device.type == "cpu":
        from specdec.models.heap import release_freed_memory

        release_freed_memory()  # what calibrating and warming up freed
    return engine


async def _serve(args: argparse.Namespace, experiments: Any = None) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    progress = Progress()
    loading = LoadingApp(progress)
    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    logging.getLogger("hypercorn.error").propagate = False  # it has its own handler
    config.graceful_timeout = 5.0  # connections are idle by then: the engine drained first
    stop = asyncio.Event()
    drained: list[asyncio.Task[None]] = []
    engines: list[AsyncEngine] = []

    async def drain() -> None:
        log.info("shutting down: finishing in-flight requests (grace %.0fs)",
                 args.shutdown_grace)
        if engines:
            await engines[0].shutdown(args.shutdown_grace)
        stop.set()

    def on_signal() -> None:
        if drained:  # a second signal: stop now
            stop.set()
            return
        drained.append(asyncio.ensure_future(drain()))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    async def load() -> None:
        t0 = time.monotonic()
        # Built on the engine's own thread, which then runs every step (see AsyncEngine).
        aengine = AsyncEngine(build=lambda: _load(args, progress), max_waiting=args.max_waiting)
        await asyncio.to_thread(aengine.ready.wait)
        if aengine.build_error is not None:  # stay up to say why, as /health and in the log
            e = aengine.build_error
            log.error("loading failed", exc_info=(type(e), e, e.__traceback__))
            progress.fail(f"{type(e).__name__}: {e}")
            return
        engines.append(aengine)
        infill = None if args.infill_speculative == "default" else {
            "method": args.infill_speculative}
        try:
            app = build_app(aengine, api_key=args.api_key, experiments=experiments,
                            model_name=args.served_model_name, infill_speculative=infill,
                            draft_models=named(args.draft_models, "--draft-models"),
                            eagle_heads=named(args.eagle_heads, "--eagle-heads"),
                            allowed_hosts=allowed_hosts_from_args(args),
                            allowed_origins=split_list(args.allowed_origins),
                            body_timeout=args.body_timeout,
                            max_concurrent_per_client=args.max_concurrent_per_client)
        except ValueError as exc:  # an experiment's arm names a model this server lacks
            log.error("%s", exc)
            progress.fail(str(exc))
            return
        loading.ready(app)
        log.info("ready after %.1f s: serving %s on http://%s:%d", time.monotonic() - t0,
                 args.model, args.host, args.port)

    log.info("listening on http://%s:%d; /health answers 503 until the models are loaded",
             args.host, args.port)
    loader = asyncio.ensure_future(load())
    await serve(loading, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    loader.cancel()


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    named(args.draft_models, "--draft-models")  # a malformed list fails here, before loading
    named(args.eagle_heads, "--eagle-heads")
    engine_kwargs(args)  # so do a malformed --engine-arg and SPECDEC_* variable
    if (args.max_concurrent_per_client or 1) < 1 or args.body_timeout <= 0:
        raise SystemExit("--max-concurrent-per-client and --body-timeout must be positive")
    try:  # before loading: a bad experiment file fails now
        experiments = open_experiments(args.experiments, args.experiments_db)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    # The engine thread gives up the GIL in every kernel call and must win it back from the
    # event loop's thread; a shorter switch interval bounds that wait (default 5 ms).
    sys.setswitchinterval(0.0005)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args, experiments))
    return 0
