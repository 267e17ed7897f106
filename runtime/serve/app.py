"""engine-serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the in-flight executor.

Every request goes through runtime.async_engine: validation and tokenization run in worker threads,
tokens reach the event loop through asyncio queues, and a client that goes away cancels its requests
(their KV slots are freed at the executor's next step)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from dataclasses import dataclass, fields
from pathlib import Path
from typing import AsyncIterator

import click
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from runtime.async_engine import AsyncLLM, AsyncRequest
from runtime.cli import KV_MEMORY_OPTIONS, config_options
from runtime.config import LoadConfig
from runtime.request.chat import ChatTemplateError
from runtime.engine import LLM, RequestError
from runtime.batching.executor import Completion
from runtime.serve.access_log import AccessLog
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocol import APIError, ChatRequest, CompletionRequest, Shape, parse, usage
from runtime.manifest.version import __version__
from runtime.serve.transport import HostGuard, RunningServer, Transport, default_hosts, log, serve
from runtime.request.spec_state import draft_problem
from runtime.speculation.speculator import Speculation

__all__ = ["RunningServer", "ServeLimits", "Transport", "create_app", "main"]


# The runtime's errors name the Python API's arguments; an HTTP client sets JSON fields, and cannot reload the
# engine (#23: each surface speaks its own language).
HTTP_FIELDS = {"max_new_tokens": "max_tokens"}
_HTTP_PHRASES = {" or load the engine with a larger max_seq_len": "", "max_new_tokens": "max_tokens"}


def http_voice(message: str) -> str:
    """`message` in the JSON fields an OpenAI-style client sends."""
    for python, http in _HTTP_PHRASES.items():
        message = message.replace(python, http)
    return message


@dataclass(frozen=True)
class ServeLimits:
    """max_concurrency: generation requests (each of n choices counts) in flight before a 429;
    max_body_bytes: request body size (413 above); max_prompt_tokens: prompt length (400 above;
    None: the engine's max_seq_len bounds prompt + max_tokens)."""

    max_concurrency: int = 64
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {self.max_prompt_tokens}")


async def _merged(requests: list[AsyncRequest]) -> AsyncIterator[tuple[int, str | None]]:
    """(choice index, text of the outputs ready) from every request as they come; (index, None) when
    one ends. Outputs that queued up while the client was being written to go out as one text."""
    if len(requests) == 1:
        while batch := await requests[0].next_batch():
            yield 0, "".join(o.text for o in batch)
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, request: AsyncRequest) -> None:
        while batch := await request.next_batch():
            queue.put_nowait((i, "".join(o.text for o in batch)))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        ended = 0
        while ended < len(requests):
            i, text = await queue.get()
            ended += text is None
            yield i, text
    finally:
        for task in tasks:
            task.cancel()


class _Stream(StreamingResponse):
    """A streaming response that closes its generator however it ends: a client gone mid-stream
    cancels its requests at once, not when the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class ClientGone(Exception):
    """The client went away before its answer: nothing is sent, one log line says what was dropped."""


class Server:
    """The routes' logic over named engines, with the app's metrics and limits."""

    def __init__(self, engines: dict[str, LLM], api_key: str | None, limits: ServeLimits, transport: Transport):
        if not engines:
            raise ValueError("serve at least one engine")
        self.engines = {name: AsyncLLM(llm) for name, llm in engines.items()}
        self.api_key, self.limits, self.transport = api_key, limits, transport
        self.metrics = ServerMetrics(engines)
        self.in_flight = 0  # sequences admitted (each of n choices of each prompt) and not yet ended
        self._tasks: set[asyncio.Task] = set()  # one per request until it ends: in-flight count and metrics

    def check_auth(self, request: Request) -> None:
        """The key, compared in constant time (a timing attack learns nothing of it)."""
        if self.api_key is None:
            return
        sent = request.headers.get("authorization", "").encode("latin-1")  # the header's own bytes
        if not hmac.compare_digest(sent, f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")

    @staticmethod
    def check_json(request: Request) -> None:
        """Only JSON bodies: a text/plain or form body (which a web page can send without a CORS
        preflight) is refused before it is read."""
        kind = request.headers.get("content-type", "")
        if kind.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, f"the body must be JSON sent as `Content-Type: application/json`, got "
                                f"{kind[:60]!r}", code="unsupported_media_type")

    async def body(self, request: Request) -> bytes:
        """The body, within the size limit (413) and the body timeout (408); ClientGone if the client leaves."""
        limit = self.limits.max_body_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.transport.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"the request body exceeds {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.transport.body_timeout:g} s",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientGone(f"client left after {size} bytes of a request body") from None
        return b"".join(chunks)

    def engine(self, name: str) -> AsyncLLM:
        if name not in self.engines:
            shown = name if len(name) <= 64 else f"{name[:64]}..."
            raise APIError(404, f"model {shown!r} is not served here; models: {sorted(self.engines)}", "model",
                           code="model_not_found")
        return self.engines[name]

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "engine-serve",
             "max_model_len": engine.llm.max_seq_len} for name, engine in self.engines.items()]}

    def admit(self, count: int) -> None:
        """Reserve `count` sequences (prompts x n) of the concurrency limit, before any tokenizing or
        per-sequence work, or refuse with a 429."""
        limit = self.limits.max_concurrency
        if count > limit:
            raise APIError(429, f"the request asks for {count} sequences (prompts x n); this server runs at most "
                                f"{limit} at once: send fewer prompts or a smaller n", type="rate_limit_error",
                           code="too_many_sequences")
        if self.in_flight + count > limit:
            raise APIError(429, f"the server is at its limit of {limit} requests in flight; retry later",
                           type="rate_limit_error", headers={"Retry-After": "1"})
        self.in_flight += count

    # -- generation ------------------------------------------------------------------------------
    def _speculation(self, engine: AsyncLLM, req) -> Speculation | None:
        if draft_problem(req.speculation, engine.llm.draft_runner is not None):  # its wording is for the CLI/API
            raise APIError(400, f"speculation 'draft' needs a draft engine; model {req.model!r} is served without "
                                f"one: ask for 'ngram' or 'none'", "speculation")
        if req.speculation is None:  # the engine's default: its draft, unless sampling is seeded
            return Speculation("draft") if engine.llm.draft_runner is not None and req.seed is None else None
        return None if req.speculation == "none" else Speculation(req.speculation)

    def _sequences(self, engine: AsyncLLM, req, prompts: list, limit: int | None) -> list:
        """Validate every choice of every prompt (runs in a worker thread), through the Python API's one
        validation path: a text prompt over the byte bound is refused before it is tokenized."""
        llm, seqs = engine.llm, []
        for i, prompt in enumerate(prompts):
            ids = llm.prompt_ids(prompt)
            if self.limits.max_prompt_tokens is not None and len(ids) > self.limits.max_prompt_tokens:
                raise APIError(400, f"prompt {i} has {len(ids)} tokens; this server accepts at most "
                                    f"{self.limits.max_prompt_tokens}", "prompt", code="context_length_exceeded")
            new = limit if limit is not None else max(1, llm.max_seq_len - len(ids))
            seqs += [llm.make_sequence(ids, req.sampling(new, j), self._speculation(engine, req))
                     for j in range(req.n)]
        return seqs

    async def _validated(self, engine: AsyncLLM, req, chat: bool) -> list:
        """The request's sequences, or a 400 naming the field (never a server path or a CLI hint)."""
        field = "messages" if chat else "prompt"
        try:
            if chat:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                prompts, limit = [await engine.apply_chat_template(messages)], req.limit
            else:
                prompts, limit = req.prompts(), req.max_tokens
            return await asyncio.to_thread(self._sequences, engine, req, prompts, limit)
        except ChatTemplateError:
            raise APIError(400, f"model {req.model!r} has no chat template; send a prompt to /v1/completions",
                           field) from None
        except jinja2.TemplateError as err:  # the template's own refusal (roles out of order, ...)
            raise APIError(400, f"the chat template refused the messages: {err}", field) from None
        except RequestError as err:
            raise APIError(400, http_voice(str(err)), HTTP_FIELDS.get(err.field, field)) from None
        except ValueError as err:
            raise APIError(400, http_voice(str(err)), field) from None

    async def generate(self, request: Request, chat: bool) -> Response:
        self.check_auth(request)
        self.check_json(request)
        req = parse(ChatRequest if chat else CompletionRequest, await self.body(request))
        engine = self.engine(req.model)
        try:
            count = req.n * (1 if chat else len(req.prompts()))
            self.admit(count)  # before any tokenizing: a request that will be refused costs nothing
        except APIError:
            self.metrics.rejected(req.model)
            raise
        try:
            seqs = await self._validated(engine, req, chat)
        except BaseException as err:
            self.in_flight -= count
            if isinstance(err, APIError):
                self.metrics.rejected(req.model)
            raise
        requests = [engine.submit_sequence(s) for s in seqs]
        for r in requests:  # counted out when it ends, whatever becomes of the response
            self._tasks.add(task := asyncio.create_task(self._record(req.model, r)))
            task.add_done_callback(self._tasks.discard)
        shape = Shape(chat, req.model)
        if req.stream:
            return _Stream(self._stream(shape, requests, req.n, req.include_usage, request.scope.setdefault("state", {})),
                           media_type="text/event-stream")
        try:
            completions = await self._wait(request, requests)
        finally:
            self._release(requests)
        if any(c.finish_reason == "error" for c in completions):
            error = next(c.error for c in completions if c.finish_reason == "error")
            raise APIError(500, f"generation failed: {error}", type="server_error")
        body = shape.response([(c.text, c.finish_reason) for c in completions], self._usage(req.n, completions))
        request.state.tokens = sum(len(c.token_ids) for c in completions)  # for the access log
        return JSONResponse(body)

    async def _wait(self, request: Request, requests: list[AsyncRequest]) -> list[Completion]:
        """Every request's completion; a client that disconnects meanwhile cancels them all (ClientGone)."""
        results = asyncio.ensure_future(asyncio.gather(*(r.result() for r in requests)))
        while not results.done():
            await asyncio.wait({results}, timeout=0.25)
            if not results.done() and await request.is_disconnected():
                results.cancel()
                await asyncio.wait({results})  # the requests are cancelled: retrieve the outcome (no warning)
                results.cancelled() or results.exception()
                raise ClientGone(f"client left before its answer: cancelled {len(requests)} request(s)")
        return await results

    @staticmethod
    def _usage(n: int, completions: list[Completion]) -> dict:
        """Prompt tokens once per prompt (not per choice, as OpenAI counts), every choice's tokens."""
        return usage(sum(c.prompt_tokens for c in completions[::n]), sum(len(c.token_ids) for c in completions))

    async def _stream(self, shape: Shape, requests: list[AsyncRequest], n: int,
                      include_usage: bool, state: dict) -> AsyncIterator[str]:
        ended = False
        try:
            if shape.chat:
                for i in range(len(requests)):
                    yield _sse(shape.chunk(i, None, role=True, with_usage=include_usage))
            completions = {}
            async for i, text in _merged(requests):
                if text is not None:
                    if text:
                        yield _sse(shape.chunk(i, text, with_usage=include_usage))
                    continue
                completions[i] = c = requests[i].handle.result(timeout=0)
                state["tokens"] = state.get("tokens", 0) + len(c.token_ids)  # for the access log
                if c.finish_reason == "error":
                    yield _sse(APIError(500, f"generation failed: {c.error}", type="server_error").body())
                    break
                yield _sse(shape.chunk(i, None, c.finish_reason, with_usage=include_usage))
            else:
                if include_usage:
                    yield _sse(shape.usage_chunk(self._usage(n, [completions[i] for i in sorted(completions)])))
            yield _sse("[DONE]")
            ended = True
        finally:
            if not ended:
                log.warning("a %s stream of model %r ended before its last chunk (client gone or server stopping): "
                            "cancelled %d request(s)", "chat" if shape.chat else "completion", shape.model, len(requests))
            self._release(requests)

    @staticmethod
    def _release(requests: list[AsyncRequest]) -> None:
        """Cancel what has not ended (a client gone)."""
        for r in requests:
            r.cancel()

    async def _record(self, model: str, request: AsyncRequest) -> None:
        completion = await request.ended()
        self.in_flight -= 1
        self.metrics.finished(model, completion)


def create_app(engines: dict[str, LLM], api_key: str | None = None, limits: ServeLimits | None = None,
               transport: Transport | None = None, metrics_public: bool = False,
               allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The ASGI app serving `engines` by name (the caller loads and closes them). With `api_key`, every
    route but /health needs it (/version and /metrics too unless `metrics_public`); `allowed_hosts`: the
    Host header names served (None: any), see transport.default_hosts."""
    server = Server(engines, api_key, limits or ServeLimits(), transport or Transport())
    app = FastAPI(title="engine-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
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

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version(request: Request) -> dict:
        if not metrics_public:
            server.check_auth(request)
        return {"version": __version__, "models": sorted(server.engines)}  # names only: no server paths

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not metrics_public:
            server.check_auth(request)
        return Response(await asyncio.to_thread(server.metrics.render), media_type="text/plain; version=0.0.4")

    return app


def _engine_args(values: tuple[str, ...]) -> dict[str, Path]:
    engines: dict[str, Path] = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        name = name or Path(path).resolve().name
        if name in engines:
            raise click.BadParameter(f"two engines are named {name!r}; name them with NAME=DIR", param_hint="--engine")
        engines[name] = Path(path)
    return engines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_args", multiple=True, required=True, metavar="[NAME=]DIR",
              help="An engine directory to serve, named NAME (default: the directory's name); repeatable.")
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
@config_options(LoadConfig, KV_MEMORY_OPTIONS)
@config_options(Transport, [f.name for f in fields(Transport)])
def main(engine_args, host, port, api_key, max_concurrency, max_body_bytes, max_prompt_tokens, draft, threads,
         process_thread_pool, metrics_public, allowed_hosts, kv_memory_mb, block_size, prefix_caching,
         log_level, **transport_options):
    """Serve prebuilt engines over an OpenAI-compatible HTTP API."""
    logging.basicConfig(format="%(asctime)s engine-serve %(levelname)s %(message)s", level=log_level.upper())
    try:
        transport = Transport(**transport_options)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    paths = _engine_args(engine_args)
    port_free(host, port)  # before the engines load: a busy port is found in a second, not after loading them
    has_draft = draft is not None or any((path / "draft").is_dir() for path in paths.values())
    pool = has_draft if process_thread_pool is None else process_thread_pool
    engines = {name: LLM(path, threads=threads, draft=draft if i == 0 else None, process_thread_pool=pool,
                         kv_memory_mb=kv_memory_mb, block_size=block_size, prefix_caching=prefix_caching)
               for i, (name, path) in enumerate(paths.items())}
    app = create_app(engines, api_key, ServeLimits(max_concurrency, max_body_bytes, max_prompt_tokens), transport,
                     metrics_public, default_hosts(host, allowed_hosts))
    click.echo(f"engine-serve: {', '.join(engines)} on http://{host}:{port}", err=True)
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
    main()
