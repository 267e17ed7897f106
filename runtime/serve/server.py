"""The routes' logic behind engine-serve: auth, body and content-type checks, admission against the
concurrency limit before any per-sequence work, validation through the Python API's one path, and the
answer, whole or streamed (runtime/serve/stream.py). app.py wires it into FastAPI and the CLI."""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from runtime.async_engine import AsyncLLM, AsyncRequest
from runtime.batching.executor import Completion
from runtime.engine import LLM, RequestError
from runtime.request.chat import ChatTemplateError
from runtime.request.validate import TOO_LONG
from runtime.serve.logprobs import Answer
from runtime.speculation.speculator import draft_kind, draft_problem
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocol import (APIError, ChatRequest, CompletionRequest, LoadLoRARequest, Shape,
                                    UnloadLoRARequest, parse, sse, usage)
from runtime.serve.stream import EventStream, merged
from runtime.serve.transport import Transport, log
from runtime.speculation.speculator import Speculation


# The runtime's errors name the Python API's arguments; an HTTP client sets JSON fields, and cannot reload the
# engine (#23: each surface speaks its own language).
HTTP_FIELDS = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs", "speculation": "speculation"}
_HTTP_PHRASES = {" or load the engine with a larger max_seq_len": "", "max_new_tokens": "max_tokens"}
_CHAT_PHRASES = {"the prompt has": "the messages, as the chat template renders them, have",
                 "the prompt:": "the messages, as the chat template renders them:", "the prompt is": "the messages are"}


def http_voice(message: str, limit_field: str = "max_tokens", chat: bool = False) -> str:
    """`message` in the JSON fields an OpenAI-style client sends: the length limit under the name the client
    used (`max_completion_tokens` or `max_tokens`), a chat's prompt called its messages."""
    phrases = {**_HTTP_PHRASES, "max_new_tokens": limit_field, **(_CHAT_PHRASES if chat else {})}
    for python, http in phrases.items():
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


class ClientGone(Exception):
    """The client went away before its answer: nothing is sent, one log line says what was dropped."""


class Server:
    """The routes' logic over named engines, with the app's metrics and limits."""

    def __init__(self, engines: dict[str, LLM], api_key: str | None, limits: ServeLimits, transport: Transport,
                 runtime_lora: bool = False):
        if not engines:
            raise ValueError("serve at least one engine")
        self.engines = {name: AsyncLLM(llm) for name, llm in engines.items()}
        self.api_key, self.limits, self.transport = api_key, limits, transport
        self.runtime_lora = runtime_lora  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer (else 403)
        clash = sorted(set(self.engines) & set(self.adapters()))
        if clash:
            raise ValueError(f"LoRA adapters named like a served engine: {clash}; give them other names")
        self.metrics = ServerMetrics(engines)
        self.in_flight = 0  # sequences admitted (each of n choices of each prompt) and not yet ended
        self.stopping = False  # the shutdown grace period is ending: what is open is cancelled and answered 503
        self._open: set[tuple[AsyncRequest, ...]] = set()  # each open response's requests

    def stop_generation(self) -> None:
        """Shutdown: cancel every open response's requests (generating or queued); each is answered 503, a
        stream with a final error event, and logged once. Later requests get a 503 at once."""
        self.stopping = True
        for group in list(self._open):
            for r in group:
                r.cancel()

    def _check_running(self, what: str) -> None:
        if self.stopping:
            log.warning("%s: answered 503, server shutting down", what)
            raise APIError(503, "server shutting down; retry on another server or later", type="server_error",
                           code="server_shutting_down")

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

    def adapters(self) -> dict[str, str]:
        """Each loaded LoRA adapter's name and the engine it runs on (the engines' adapter pools own them)."""
        return {adapter: name for name, engine in self.engines.items() for adapter in engine.llm.adapters}

    def engine(self, name: str) -> tuple[AsyncLLM, str | None]:
        """The engine serving model `name` and the LoRA adapter it names (None: the engine's base model); a 404
        naming the models served when it is none of them."""
        if name in self.engines:
            return self.engines[name], None
        parent = self.adapters().get(name)
        if parent is None:
            shown = name if len(name) <= 64 else f"{name[:64]}..."
            raise APIError(404, f"model {shown!r} is not served here; models: {self.model_names()}", "model",
                           code="model_not_found")
        return self.engines[parent], name

    def model_names(self) -> list[str]:
        """Every model a request may name: the engines, then the adapters."""
        return sorted(self.engines) + sorted(self.adapters())

    def models(self) -> dict:
        """/v1/models: each engine (parent null) and each adapter with its engine as parent, as vLLM lists them."""
        entries = [(name, None, engine) for name, engine in self.engines.items()]
        entries += [(adapter, parent, self.engines[parent]) for adapter, parent in sorted(self.adapters().items())]
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "engine-serve", "parent": parent,
             "max_model_len": engine.llm.max_seq_len} for name, parent, engine in entries]}

    # -- LoRA adapters at run time (vLLM's routes) -----------------------------------------------
    async def _lora_body(self, request: Request, shape):
        self.check_auth(request)
        if not self.runtime_lora:
            raise APIError(403, "loading and unloading LoRA adapters is off on this server; start engine-serve with "
                                "--allow-runtime-lora", type="permission_error", code="runtime_lora_disabled")
        self.check_json(request)
        return parse(shape, await self.body(request))

    async def load_adapter(self, request: Request) -> Response:
        """Load a PEFT directory as a new model on the first engine (the one --lora-modules load onto)."""
        req = await self._lora_body(request, LoadLoRARequest)
        if req.lora_name in self.engines or req.lora_name in self.adapters():
            raise APIError(400, f"the lora adapter {req.lora_name!r} has already been loaded, or names a served "
                                f"model; models: {self.model_names()}", "lora_name")
        name, engine = next(iter(self.engines.items()))
        try:
            await asyncio.to_thread(engine.llm.load_adapter, req.lora_name, req.lora_path)
        except (OSError, ValueError) as err:  # not a PEFT directory, a rank or target the engine cannot serve, ...
            raise APIError(400, f"cannot load lora adapter {req.lora_name!r} onto model {name!r}: "
                                f"{http_voice(str(err)).replace(str(engine.llm.engine_dir), name)}", "lora_path") from None
        log.info("loaded LoRA adapter %r onto model %r", req.lora_name, name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    async def unload_adapter(self, request: Request) -> Response:
        """Unload an adapter: new requests may no longer name it; those running on it finish first."""
        req = await self._lora_body(request, UnloadLoRARequest)
        parent = self.adapters().get(req.lora_name)
        if parent is None:
            raise APIError(404, f"the lora adapter {req.lora_name!r} cannot be found; loaded adapters: "
                                f"{sorted(self.adapters())}", "lora_name", code="lora_adapter_not_found")
        try:  # new requests naming it are refused at once; this waits for those running on it to finish
            await asyncio.to_thread(self.engines[parent].llm.unload_adapter, req.lora_name)
        except ValueError as err:  # unloaded meanwhile by another request
            raise APIError(404, str(err), "lora_name", code="lora_adapter_not_found") from None
        log.info("unloaded LoRA adapter %r of model %r", req.lora_name, parent)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

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
        kind = draft_kind(engine.llm.draft_runner)
        if draft_problem(req.speculation, kind):  # its wording is for the CLI/API
            need = "an EAGLE head" if req.speculation == "eagle" else "a draft engine"
            raise APIError(400, f"speculation {req.speculation!r} needs {need}; model {req.model!r} is served without "
                                f"one: ask for 'ngram' or 'none'", "speculation")
        if req.speculation is None:  # the engine's default: its draft (model or head), unless seeded or scored
            plain = req.seed is None and req.scoring() == (None, None) and req.structured()[1] is None
            return Speculation("eagle" if kind == "eagle" else "draft") if kind is not None and plain else None
        return None if req.speculation == "none" else Speculation(req.speculation)

    def _sequences(self, engine: AsyncLLM, req, prompts: list, limit: int | None, adapter: str | None) -> list:
        """Validate every choice of every prompt (runs in a worker thread), through the Python API's one
        validation path: a text prompt over the byte bound is refused before it is tokenized."""
        llm, seqs, many = engine.llm, [], len(prompts) > 1
        for i, prompt in enumerate(prompts):
            try:
                ids = llm.prompt_ids(prompt)
                if self.limits.max_prompt_tokens is not None and len(ids) > self.limits.max_prompt_tokens:
                    raise RequestError(f"the prompt has {len(ids)} tokens; this server accepts at most "
                                       f"{self.limits.max_prompt_tokens}", code=TOO_LONG)
                new = max(1, limit) if limit is not None else max(1, llm.max_seq_len - len(ids))  # 0: scored alone
                seqs += [llm.make_sequence(ids, req.sampling(new, j, adapter), self._speculation(engine, req))
                         for j in range(req.n)]
            except RequestError as err:  # which prompt, when there are several
                raise RequestError(f"prompt {i}: {err}", err.field, err.code) if many else err from None
        return seqs

    async def _validated(self, engine: AsyncLLM, req, chat: bool, adapter: str | None) -> list:
        """The request's sequences, or a 400 naming the field (never a server path or a CLI hint)."""
        field = "messages" if chat else "prompt"
        try:
            if chat:
                messages = [m.for_template() for m in req.messages]
                prompts, limit = [await engine.chat_prompt_ids(messages, req.template_tools())], req.limit
            else:
                prompts, limit = req.prompts(), req.max_tokens
            return await asyncio.to_thread(self._sequences, engine, req, prompts, limit, adapter)
        except ChatTemplateError as err:
            raise APIError(400, f"model {req.model!r} has no chat template; send a prompt to /v1/completions",
                           field) from None
        except jinja2.TemplateError as err:  # the template's own refusal (roles out of order, ...)
            raise APIError(400, f"the chat template refused the messages: {err}", field) from None
        except RequestError as err:
            limit_field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            param = {"max_new_tokens": limit_field, "structured": req.structured()[0]}.get(err.field) or \
                HTTP_FIELDS.get(err.field, field)
            raise APIError(400, http_voice(str(err), limit_field, chat), param, code=err.code) from None
        except ValueError as err:
            raise APIError(400, http_voice(str(err), chat=chat), field) from None

    async def generate(self, request: Request, chat: bool) -> Response:
        what = f"{request.method} {request.url.path[:80]}"
        self._check_running(what)
        self.check_auth(request)
        self.check_json(request)
        req = parse(ChatRequest if chat else CompletionRequest, await self.body(request))
        engine, adapter = self.engine(req.model)
        try:
            count = req.n * (1 if chat else len(req.prompts()))
            self.admit(count)  # before any tokenizing: a request that will be refused costs nothing
        except APIError:
            self.metrics.rejected(req.model)
            raise
        try:
            seqs = await self._validated(engine, req, chat, adapter)
            self._check_running(what)
        except BaseException as err:
            self.in_flight -= count
            if isinstance(err, APIError):
                self.metrics.rejected(req.model)
            raise
        requests = [engine.submit_sequence(s) for s in seqs]
        group = tuple(requests)
        self._open.add(group)  # until its last request ends (stop_generation cancels what is open)
        for r in requests:  # counted out when it ends, whatever becomes of the response
            r.add_done_callback(lambda ended: self._record(req.model, ended, group))
        shape = Shape(chat, req.model, with_usage=req.stream and req.include_usage)
        answer = Answer(req, chat, engine.llm.tokenizer, [r.handle.seq for r in requests])
        if req.stream:
            return EventStream(self._stream(shape, answer, requests, req.n, request.scope.setdefault("state", {})))
        try:
            completions = await self._wait(request, requests)
        finally:
            self._release(requests)
        if self.stopping and any(c.finish_reason == "cancelled" for c in completions):
            self._check_running(f"{what}: cancelled {len(requests)} request(s)")
        if any(c.finish_reason == "error" for c in completions):
            error = next(c.error for c in completions if c.finish_reason == "error")
            raise APIError(500, f"generation failed: {error}", type="server_error")
        completions = [answer.trimmed(c) for c in completions]
        body = shape.response([answer.choice(i, c) for i, c in enumerate(completions)], self._usage(req.n, completions))
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

    async def _stream(self, shape: Shape, answer: Answer, requests: list[AsyncRequest], n: int,
                      state: dict) -> AsyncIterator[bytes]:
        """The stream's events; what is ready at once goes out as one write (a choice's last text with its
        finish chunk, the usage chunk and [DONE]): a write's fixed cost is paid per batch, not per event.
        Cut by shutdown, it ends with one 503 error event and [DONE]."""
        ended = False
        try:
            events = [sse(shape.chunk(i, None, role=True)) for i in range(len(requests))] if shape.chat else []
            completions: dict[int, Completion] = {}
            async for ready in merged(requests):
                for i, text, tokens in ready:
                    if answer.scored or answer.echo:
                        events += [sse(chunk) for chunk in answer.stream_chunks(shape, i, text, tokens)]
                    elif answer.tool_streams is not None:
                        events += [sse(chunk) for chunk in answer.tool_chunks(shape, i, text)]
                    elif text:
                        events.append(shape.text_event(i, text))
                    if text is None:
                        completions[i] = c = requests[i].handle.result(timeout=0)
                        state["tokens"] = state.get("tokens", 0) + len(c.token_ids)  # for the access log
                        if not (self.stopping and c.finish_reason == "cancelled"):
                            events.append(self._end_event(shape, i, c, answer.stream_reason(i, c.finish_reason)))
                if self.stopping and any(c.finish_reason == "cancelled" for c in completions.values()):
                    log.warning("a %s stream of model %r cut by shutdown: sent a 503 error event, cancelled %d "
                                "request(s)", "chat" if shape.chat else "completion", shape.model, len(requests))
                    error = APIError(503, "server shutting down", type="server_error", code="server_shutting_down")
                    yield b"".join(events) + sse(error.body()) + sse("[DONE]")
                    ended = True
                    return
                failed = any(c.finish_reason == "error" for c in completions.values())
                if failed or len(completions) == len(requests):
                    if shape.with_usage and not failed:
                        events.append(sse(shape.usage_chunk(self._usage(n, [completions[i] for i in sorted(completions)]))))
                    yield b"".join(events) + sse("[DONE]")
                    ended = True
                    return
                if events:  # not when the texts ready were all empty (a character still incomplete)
                    yield b"".join(events)
                events = []
        finally:
            if not ended:
                log.warning("a %s stream of model %r ended before its last chunk (client gone or server stopping): "
                            "cancelled %d request(s)", "chat" if shape.chat else "completion", shape.model, len(requests))
            self._release(requests)

    @staticmethod
    def _end_event(shape: Shape, index: int, completion: Completion, reason: str) -> bytes:
        if completion.finish_reason == "error":
            return sse(APIError(500, f"generation failed: {completion.error}", type="server_error").body())
        return sse(shape.chunk(index, None, reason))

    @staticmethod
    def _release(requests: list[AsyncRequest]) -> None:
        """Cancel what has not ended (a client gone)."""
        for r in requests:
            r.cancel()

    def _record(self, model: str, request: AsyncRequest, group: tuple[AsyncRequest, ...]) -> None:
        self.in_flight -= 1
        self.metrics.finished(model, request.handle.result(timeout=0))
        if all(r.handle.finish_reason is not None for r in group):
            self._open.discard(group)
