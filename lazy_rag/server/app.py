"""The HTTP app (FastAPI): the OpenAI routes over one ``LazyLLM`` (and optionally one
``LazyIndex``), health and readiness, Prometheus metrics, and the web page.

Every error a client sees is an OpenAI error object with a status code; a bug is a 500 whose body
says only that (the traceback goes to the server log). The body-size limit and the API key are
checked before any model work.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LazyRagError
from ..requests import MODES
from .driver import ClientGoneError, DrainingError, EngineDriver, EngineUnavailableError, QueueFullError
from .limits import BodySizeLimit
from .metrics import RequestCounter, ServerMetrics
from .prompts import PromptBuilder
from .protocol import APIError, GenerationRequest, bad, parse_chat, parse_completion

log = logging.getLogger("lazy_rag.server")
STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServerSettings:
    """``api_key``: required as ``Authorization: Bearer`` on /v1/* when set. ``max_queue``:
    requests in the engine at once (more get 429). ``max_body_bytes``: larger bodies get 413.
    ``default_max_tokens``: when a request names none. ``log_prompts``: log prompt text."""

    model_name: str = "lazy-rag"
    api_key: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    default_mode: str = "lazy"
    log_prompts: bool = False

    def __post_init__(self):
        if self.default_mode not in MODES:
            raise LazyRagError(f"Unknown mode {self.default_mode!r}; choose one of {', '.join(MODES)}.")
        if self.max_body_bytes < 1024:
            raise LazyRagError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}.")
        if self.default_max_tokens < 1:
            raise LazyRagError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}.")


class LazyRagServer:
    """What the routes share: the model, the engine driver, the prompt builder, the metrics."""

    def __init__(self, llm, index=None, settings: ServerSettings | None = None):
        self.llm, self.index = llm, index
        self.settings = settings or ServerSettings()
        source = None if index is None else index.chunk_source
        self.driver = EngineDriver(llm.engine, self.settings.max_queue, source)  # the engine is built here: /ready
        # the builder's own tokenizer: the engine decodes with the original during steps
        self.builder = PromptBuilder(copy.deepcopy(llm.tokenizer), index)
        self.metrics = ServerMetrics(self.driver)
        self.started = int(time.time())

    @property
    def draining(self) -> bool:
        return self.driver.draining

    def start_draining(self) -> None:
        """Stop admitting (503), keep serving what is in flight (SIGTERM)."""
        self.driver.draining = True
        self.metrics.draining.set(1)

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                                "--api-key or LAZY_RAG_API_KEY).", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def info(self) -> dict:
        return {"model": self.settings.model_name, "modes": list(MODES), "default_mode": self.settings.default_mode,
                "context_window": self.llm.context_window, "device": str(self.llm.device),
                "index": None if self.index is None else {"path": str(self.index.path),
                                                          "chunks": len(self.index.records)}}

    # -- generation -------------------------------------------------------------------------------
    async def admit(self, req: GenerationRequest):
        """Build the prompt and hand it to the engine. Returns (prepared prompt, ticket)."""
        if req.model != self.settings.model_name:
            raise APIError(404, f"The model {req.model!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (GET /v1/models).", param="model",
                           code="model_not_found")
        mode = req.mode or self.settings.default_mode
        s = req.sampling
        try:
            # retrieval embeds the question and span matching tokenizes: off the event loop
            prepared = await asyncio.to_thread(self.builder.build, req, mode)
            ticket = await self.driver.submit(prepared.segments, uses_index=prepared.uses_index, mode=mode,
                                              max_new_tokens=s.max_tokens or self.settings.default_max_tokens,
                                              temperature=s.temperature, top_p=s.top_p, stop=list(s.stop),
                                              seed=s.seed, recovery=prepared.recovery)
            return prepared, ticket
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        except DrainingError as e:
            raise APIError(503, str(e), type="server_error", code="draining", headers={"Retry-After": "5"})
        except EngineUnavailableError as e:
            raise unavailable(e)
        except APIError:
            raise
        except LazyRagError as e:  # a bad request the runtime found (too long, bad recovery, ...)
            raise bad(str(e)) from None

    def finished(self, req: GenerationRequest, rid: str, result) -> None:
        st = result.stats
        self.metrics.observe(st)
        text = f" prompt={req.messages or req.prompt!r}" if self.settings.log_prompts else ""
        log.info("%s %s mode=%s prompt_tokens=%d cached=%d new=%d ttft_ms=%.1f total_ms=%.1f finish=%s%s", rid,
                 req.kind, st.mode, st.prompt_tokens, st.cached_tokens, st.new_tokens, st.ttft_ms, st.total_ms,
                 result.finish_reason, text)


def unavailable(e: EngineUnavailableError) -> APIError:
    return APIError(503, str(e), type="server_error", code="engine_unavailable")


def failed(e: LazyRagError) -> APIError:
    """A request that failed inside the engine, after admission."""
    if isinstance(e, EngineUnavailableError):
        return unavailable(e)
    if isinstance(e, ClientGoneError):  # nobody reads this answer; 499 as nginx logs it, for the metrics
        return APIError(499, str(e), type="server_error", code="client_closed_request")
    return APIError(500, str(e), type="server_error", code="request_failed")


def usage(result) -> dict:
    st = result.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens,
            "prompt_tokens_details": {"cached_tokens": st.reused_tokens}}


def lazy_rag_extra(result, prepared) -> dict:
    """lazy-rag's own response field: how the prompt was served (retrieved sources go in ``sources``)."""
    st = result.stats
    return {"mode": st.mode, "recovery": st.recovery, "ttft_ms": round(st.ttft_ms, 2),
            "total_ms": round(st.total_ms, 2), "cached_tokens": st.cached_tokens, "reused_tokens": st.reused_tokens,
            "encoded_tokens": st.encoded_tokens,
            "computed_tokens": st.computed_tokens, "chunk_sources": st.chunk_sources,
            "matched_chunks": prepared.matched_chunks}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(llm, index=None, settings: ServerSettings | None = None) -> FastAPI:
    server = LazyRagServer(llm, index, settings)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.driver.close()

    app = FastAPI(title="lazy-rag", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodySizeLimit, max_bytes=server.settings.max_body_bytes)

    # outermost: counts every answer, the limit's 413s included
    app.add_middleware(RequestCounter, counter=server.metrics.requests)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse(APIError(500, "Internal server error; the server log has the details.",
                                     type="server_error").body(), status_code=500)

    async def read_json(request: Request):
        server.check_auth(request)
        raw = await request.body()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"The request body is not valid JSON ({e}).") from None

    # -- health ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not server.driver.alive:
            return JSONResponse({"status": "engine_unavailable"}, status_code=503)
        return {"status": "ready", "model": server.settings.model_name}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/info")
    async def info():
        return server.info()

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model",
                                            "created": server.started, "owned_by": "lazy-rag",
                                            "max_model_len": server.llm.context_window}]}

    # -- generation -----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_chat(await read_json(request))
        return await respond(request, req, "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(await read_json(request))
        return await respond(request, req, "text_completion", "cmpl")

    async def respond(request: Request, req: GenerationRequest, obj: str, prefix: str):
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        prepared, ticket = await server.admit(req)
        head = {"id": rid, "object": obj, "created": created, "model": server.settings.model_name}
        if req.stream:
            return StreamingResponse(stream(req, rid, head, prepared, ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watch = asyncio.create_task(cancel_on_disconnect(request, ticket))
        try:
            text = "".join([p async for p in server.driver.pieces(ticket)])
        except LazyRagError as e:
            raise failed(e) from None
        finally:
            watch.cancel()
        result = ticket.result
        server.finished(req, rid, result)
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": result.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": None}
        body = {**head, "choices": [choice], "usage": usage(result), "lazy_rag": lazy_rag_extra(result, prepared)}
        if req.rag_top_k:
            body["sources"] = prepared.sources
        return body

    async def cancel_on_disconnect(request: Request, ticket) -> None:
        """A client that goes away before a (non-streamed) answer is done frees its request."""
        while not ticket.finished:
            if await request.is_disconnected():
                server.driver.cancel(ticket)
                return
            await asyncio.sleep(0.25)

    async def stream(req: GenerationRequest, rid: str, head: dict, prepared, ticket):
        chunk = {**head, "object": f"{head['object']}.chunk"} if req.kind == "chat" else dict(head)

        def choice(piece: str | None, finish: str | None) -> dict:
            if req.kind == "chat":
                delta = {} if piece is None else {"content": piece}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}

        if req.kind == "chat":
            yield _sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None, "logprobs": None}]})
        try:
            async for piece in server.driver.pieces(ticket):
                yield _sse({**chunk, "choices": [choice(piece, None)]})
        except LazyRagError as e:  # failed inside the engine after the headers went out
            yield _sse(failed(e).body())
            yield "data: [DONE]\n\n"
            return
        result = ticket.result
        server.finished(req, rid, result)
        last = {**chunk, "choices": [choice(None, result.finish_reason)], "lazy_rag": lazy_rag_extra(result, prepared)}
        if req.rag_top_k:
            last["sources"] = prepared.sources
        yield _sse(last)
        if req.include_usage:
            yield _sse({**chunk, "choices": [], "usage": usage(result)})
        yield "data: [DONE]\n\n"

    # -- the web page ---------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
