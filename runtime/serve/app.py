"""engine-serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the in-flight executor.

The routes' logic is runtime/serve/server.py; every request goes through runtime.async_engine:
validation and tokenization run in worker threads, tokens reach the event loop in batches (one wake-up
per executor step), and a client that goes away cancels its requests (their KV slots are freed at the
executor's next step)."""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import fields
from pathlib import Path

import click
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from runtime.cli import KV_MEMORY_OPTIONS, USAGE_ERROR, cli_voice, config_options
from runtime.config import ExecutorConfig, LoadConfig
from runtime.engine import LLM
from runtime.manifest.types import EngineError
from runtime.manifest.version import __version__
from runtime.serve.access_log import AccessLog
from runtime.serve.protocol import APIError
from runtime.serve.server import ClientGone, Server, ServeLimits
from runtime.serve.transport import HostGuard, RunningServer, Transport, default_hosts, log, serve

__all__ = ["RunningServer", "ServeLimits", "Transport", "create_app", "main"]


def create_app(engines: dict[str, LLM], api_key: str | None = None, limits: ServeLimits | None = None,
               transport: Transport | None = None, metrics_public: bool = False,
               allowed_hosts: tuple[str, ...] | None = None, runtime_lora: bool = False) -> FastAPI:
    """The ASGI app serving `engines` by name, and each engine's loaded LoRA adapters by theirs (the caller
    loads and closes them). With `api_key`, every route but /health needs it (/version and /metrics too unless
    `metrics_public`); `allowed_hosts`: the Host header names served (None: any), see transport.default_hosts;
    `runtime_lora`: /v1/load_lora_adapter and /v1/unload_lora_adapter answer (else 403)."""
    server = Server(engines, api_key, limits or ServeLimits(), transport or Transport(), runtime_lora)
    app = FastAPI(title="engine-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.stop_generation = server.stop_generation  # called by the transport as the shutdown grace ends
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=allowed_hosts)
    app.add_middleware(AccessLog)  # outermost: refused hosts are logged too

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:  # 404, 405 in OpenAI's shape
        what = f"{request.method} {request.url.path[:80]}"
        error = APIError(err.status_code, f"{err.detail}: {what}", code="not_found" if err.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone) -> Response:
        log.warning("%s %s dropped: %s", request.method, request.url.path[:80], err)
        return Response(status_code=499)  # nobody reads it

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.check_auth(request)
        return server.models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await server.load_adapter(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await server.unload_adapter(request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version(request: Request) -> dict:
        if not metrics_public:
            server.check_auth(request)
        return {"version": __version__, "models": server.model_names()}  # names only: no server paths

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not metrics_public:
            server.check_auth(request)
        return Response(await asyncio.to_thread(server.metrics.render), media_type="text/plain; version=0.0.4")

    return app


def _lora_args(values: tuple[str, ...]) -> dict[str, Path]:
    adapters: dict[str, Path] = {}
    for value in values:
        name, _, path = value.partition("=")
        if not name or not path:
            raise click.BadParameter(f"{value!r} is not NAME=PATH (a model name and a PEFT adapter directory)",
                                     param_hint="--lora-modules")
        if name in adapters:
            raise click.BadParameter(f"two adapters are named {name!r}", param_hint="--lora-modules")
        adapters[name] = Path(path)
    return adapters


def _engine_args(values: tuple[str, ...]) -> dict[str, Path]:
    engines: dict[str, Path] = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        name = name or Path(path).resolve().name
        if name in engines:
            raise click.BadParameter(f"two engines are named {name!r}; name them with NAME=DIR", param_hint="--engine")
        engines[name] = Path(path)
    return engines


class _ListOptions(click.Command):
    """Also reads vLLM's spelling of a list option, its values one after another (`--lora-modules a=P b=P`),
    as the option repeated: each word up to the next option belongs to the option before it."""

    LISTS = ("--lora-modules",)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        spread, current = [], None
        for arg in args:
            if arg == "--":
                current = None
            elif arg.startswith("-"):
                current = arg.split("=", 1)[0] if arg.split("=", 1)[0] in self.LISTS else None
            elif current and spread[-1] != current:  # a second value: the option again before it
                spread.append(current)
            spread.append(arg)
        return super().parse_args(ctx, spread)


@click.command(cls=_ListOptions, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_args", multiple=True, required=True, metavar="[NAME=]DIR",
              help="An engine directory to serve, named NAME (default: the directory's name); repeatable.")
@click.option("--lora-modules", "lora_args", multiple=True, metavar="NAME=PATH",
              help="A PEFT LoRA adapter directory served as model NAME on the first --engine (built with a lora "
                   "section); repeatable, or several after one --lora-modules (vLLM's spelling).")
@click.option("--allow-runtime-lora", is_flag=True,
              help="Answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key if set): clients "
                   "then name directories on this machine to load.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (localhost by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", envvar="ENGINE_SERVE_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1 routes (or set ENGINE_SERVE_API_KEY).")
@click.option("--max-concurrency", default=64, show_default=True, type=click.IntRange(1),
              help="Generation requests in flight before new ones get 429.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1))
@click.option("--max-prompt-tokens", default=None, type=click.IntRange(1),
              help="Refuse longer prompts (default: the engine's max_seq_len bounds prompt + max_tokens).")
@config_options(LoadConfig, ["draft", "threads"], {"draft": "A draft engine for the first --engine: its requests "
                                                            "speculate unless seeded.",
                                                   "threads": "ONNX Runtime threads per engine."})
@click.option("--process-thread-pool/--no-process-thread-pool", default=None,
              help="One ONNX Runtime thread pool for every engine of the process (default: on when a draft is served).")
@click.option("--metrics-public", is_flag=True,
              help="Answer /version and /metrics without the API key (they show model names, counts, latencies).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A Host header name to serve besides localhost names (on a loopback --host only those are "
                   "served, against DNS rebinding); on another --host, listing any restricts to the list. Repeatable.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True,
              help="info: one access line per request (method, path, status, tokens, latency); warning: problems only.")
@config_options(LoadConfig, ["device", "max_batch_size", "max_seq_len", "micro_batches"] + KV_MEMORY_OPTIONS)
@config_options(ExecutorConfig, ["overlap", "lookahead"])
@config_options(Transport, [f.name for f in fields(Transport)])
def main(engine_args, lora_args, allow_runtime_lora, host, port, api_key, max_concurrency, max_body_bytes,
         max_prompt_tokens, draft, threads, process_thread_pool, metrics_public, allowed_hosts, device, max_batch_size, max_seq_len,
         micro_batches, kv_memory_mb, block_size, prefix_caching, overlap, lookahead, log_level, **transport_options):
    """Serve prebuilt engines over an OpenAI-compatible HTTP API."""
    logging.basicConfig(format="%(asctime)s engine-serve %(levelname)s %(message)s", level=log_level.upper())
    try:
        transport = Transport(**transport_options)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    paths = _engine_args(engine_args)
    adapters = _lora_args(lora_args)
    port_free(host, port)  # before the engines load: a busy port is found in a second, not after loading them
    has_draft = draft is not None or any((path / "draft").is_dir() for path in paths.values())
    pool = has_draft if process_thread_pool is None else process_thread_pool
    try:
        engines = {name: LLM(path, threads=threads, draft=draft if i == 0 else None, process_thread_pool=pool,
                             device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                             micro_batches=micro_batches, kv_memory_mb=kv_memory_mb, block_size=block_size,
                             prefix_caching=prefix_caching, overlap=overlap, lookahead=lookahead,
                             adapters=adapters if i == 0 else None)
                   for i, (name, path) in enumerate(paths.items())}
    except (EngineError, ValueError) as err:  # an engine or option this machine cannot serve: one line, no traceback
        click.echo(f"engine-serve: error: {cli_voice(str(err))}", err=True)
        raise SystemExit(USAGE_ERROR) from None
    app = create_app(engines, api_key, ServeLimits(max_concurrency, max_body_bytes, max_prompt_tokens), transport,
                     metrics_public, default_hosts(host, allowed_hosts), allow_runtime_lora)
    click.echo(f"engine-serve: {', '.join(app.state.server.model_names())} on http://{host}:{port}", err=True)
    try:
        serve(app, transport, host, port)
    finally:
        for llm in engines.values():
            llm.close()


def port_free(host: str, port: int) -> None:
    """A click error naming host:port when it cannot be bound (in use, or not an address of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as err:
            raise click.ClickException(f"cannot listen on {host}:{port}: {err.strerror or err}; "
                                       f"choose another --port or stop what uses it") from None


if __name__ == "__main__":
    import sys

    from runtime.parallel.launch import stage_rank_runs

    stage_rank_runs(sys.argv[1:], named=True)  # under torchrun, a stage rank serves its stage instead
    main()
