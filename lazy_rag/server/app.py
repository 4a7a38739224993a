"""The HTTP app (FastAPI): the OpenAI routes over one model (and optionally one index), health
and readiness, Prometheus metrics, and the web page. The engine runs in its own process
(``ProcessDriver``, the default) or in a thread of this one (``EngineDriver``).

Every error a client sees is an OpenAI error object with a status code; a bug is a 500 whose body
says only that (the traceback goes to the server log). The body-size limit and the API key are
checked before any model work.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LazyRagError
from ..requests import MODES
from ..segments import Chunk
from .driver import ClientGoneError, DrainingError, EngineDriver, EngineUnavailableError, QueueFullError
from .embeddings import EmbeddingService, parse_embeddings
from .engine_process import ProcessDriver, RestartPolicy
from .engine_spec import EngineSpec
from .limits import BodyLimits
from .metrics import RequestCounter, ServerMetrics
from .prompts import PromptBuilder
from .protocol import APIError, GenerationRequest, bad, parse_chat, parse_completion
from .quotas import Quotas
from .remote_model import RemoteModel
from .tools import ToolCallStream, whole_message
from .tenants import ANONYMOUS, Tenant, TenantLimits, Tenants
from .warm import PublicDocuments

log = logging.getLogger("lazy_rag.server")
STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServerSettings:
    """``api_key``: required as ``Authorization: Bearer`` on /v1/* when set (one tenant).
    ``tenants``: API keys of several tenants instead (``Tenants``: each tenant's documents are
    cached apart, under its own salt, and it has its own limits). ``tenant_max_in_flight``,
    ``tenant_tokens_per_minute``, ``tenant_max_document_bytes``: every tenant's limits where the
    keys file sets none (``TenantLimits``); requests in flight default to all of ``max_queue``
    with one tenant and half of it with several, so that no tenant can fill the queue alone.
    ``max_documents``: documents in one request (more: 400). ``max_queue``:
    requests in the engine at once (more get 429). ``max_body_bytes``: larger bodies get 413.
    ``client_timeout_s``: a request's headers, and then its body, must arrive within this many
    seconds (else 408: a slow client holds only its own connection).
    ``default_max_tokens``: when a request names none. ``log_prompts``: log prompt text (never the
    documents). ``engine_restart``: how a dead engine process is replaced (``RestartPolicy``).
    ``engine_process``: run the engine in its own process (``ProcessDriver``), else in a thread
    of the server's process. On by default. Measured on the 2-core CPU machine (BENCHMARKS.md,
    "Server: HTTP against in-process"; benchmarks/server_load.py --compare-drivers): the two are equal within the
    machine's noise (saturated 3.17 vs 3.21 req/s, low load 0.92 vs 0.89, alternating rounds),
    and with it the load test meets its target (1.05x and 1.02x of in-process at saturation). So
    it costs nothing measurable there, and it removes what held the H100 at 0.81x: the event
    loop's work (JSON bodies, SSE events) taking the interpreter lock from the engine's
    host-side step work (1.66x with it there). Its costs: a second interpreter (seconds at startup, a few hundred MB)
    and, for a ``LazyLLM`` the caller loaded, a second copy of its weights."""

    model_name: str = "lazy-rag"
    api_key: str | None = None
    tenants: Tenants | None = None
    tenant_max_in_flight: int | None = None
    tenant_tokens_per_minute: int | None = None
    tenant_max_document_bytes: int | None = None
    max_documents: int = 256
    max_queue: int = 64
    max_body_bytes: int = 4 << 20
    client_timeout_s: float = 30.0
    default_max_tokens: int = 256
    default_mode: str = "lazy"
    log_prompts: bool = False
    engine_process: bool = True
    engine_restart: RestartPolicy = RestartPolicy()

    def __post_init__(self):
        if self.default_mode not in MODES:
            raise LazyRagError(f"Unknown mode {self.default_mode!r}; choose one of {', '.join(MODES)}.")
        if self.max_body_bytes < 1024:
            raise LazyRagError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}.")
        if self.default_max_tokens < 1:
            raise LazyRagError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}.")
        if not self.client_timeout_s > 0:
            raise LazyRagError(f"client_timeout_s must be positive, got {self.client_timeout_s}.")
        if self.max_documents < 1:
            raise LazyRagError(f"max_documents must be at least 1, got {self.max_documents}.")
        if self.api_key and self.tenants is not None and self.tenants.required:
            raise LazyRagError("Give either api_key (one key) or tenants (several), not both.")
        self.tenant_defaults  # checks the tenant limits

    def key_table(self) -> Tenants:
        """The API keys: ``tenants``, else ``api_key`` as one tenant, else none."""
        if self.tenants is not None:
            return self.tenants
        return Tenants.single(self.api_key) if self.api_key else Tenants.open()

    @property
    def tenant_defaults(self) -> TenantLimits:
        several = self.tenants is not None and len(self.tenants) > 1
        in_flight = self.tenant_max_in_flight or (max(1, self.max_queue // 2) if several else None)
        return TenantLimits(in_flight, self.tenant_tokens_per_minute, self.tenant_max_document_bytes)


class LazyRagServer:
    """What the routes share: the model (``llm``: a ``LazyLLM``, or a ``RemoteModel`` when the
    engine runs in its own process), the engine driver, the prompt builder, the metrics.

    ``model``: a loaded ``LazyLLM`` (with ``index`` a ``LazyIndex`` over it) or an ``EngineSpec``
    (its ``index_dir`` names the index). With ``settings.engine_process`` the engine process loads
    the model from the spec (``EngineSpec.from_llm`` for a loaded one: a second copy of its
    weights, there) and this process keeps only the tokenizer and the index's metadata and
    embedder; otherwise the engine runs here. Either way the engine exists once this returns."""

    def __init__(self, model, index=None, settings: ServerSettings | None = None):
        self.settings = settings or ServerSettings()
        self.driver, self.llm, self.index, tokenizer = open_engine(model, index, self.settings)
        self.builder = PromptBuilder(tokenizer, self.index)
        self.embeddings = EmbeddingService(self.index, self.builder.embedder_lock)
        spec = model if isinstance(model, EngineSpec) else getattr(model, "spec", None)  # Ray Serve's engines
        self.public_documents = PublicDocuments(tokenizer, spec.warm_documents if isinstance(spec, EngineSpec) else ())
        self.tenants = self.settings.key_table()
        self.quotas = Quotas(self.settings.tenant_defaults)
        self.metrics = ServerMetrics(self.driver)
        self.started = int(time.time())

    @property
    def draining(self) -> bool:
        return self.driver.draining

    def start_draining(self) -> None:
        """Stop admitting (503), keep serving what is in flight (SIGTERM)."""
        self.driver.draining = True
        self.metrics.draining.set(1)

    def check_auth(self, request: Request) -> Tenant:
        """The request's tenant, by its API key (the anonymous tenant when the server has none);
        kept in ``request.state.tenant``."""
        tenant = ANONYMOUS
        if self.tenants.required:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            tenant = self.tenants.find(token.strip()) if scheme.lower() == "bearer" else None
            if tenant is None:
                raise APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' (a key of the "
                                    "server's --api-key, --api-keys file or LAZY_RAG_API_KEYS).",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        request.state.tenant = tenant
        return tenant

    def info(self) -> dict:
        return {"model": self.settings.model_name, "modes": list(MODES), "default_mode": self.settings.default_mode,
                "context_window": self.llm.context_window, "device": str(self.llm.device),
                "engine_process": self.driver.engine_pid,
                "index": None if self.index is None else {"path": str(self.index.path),
                                                          "chunks": len(self.index.records)}}

    # -- generation -------------------------------------------------------------------------------
    async def admit(self, req: GenerationRequest, tenant: Tenant = ANONYMOUS):
        """Check the tenant's limits, build the prompt and hand it to the engine. Returns
        (prepared prompt, ticket). The tenant's documents are cached under its salt."""
        if req.model != self.settings.model_name:
            raise APIError(404, f"The model {req.model!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (GET /v1/models).", param="model",
                           code="model_not_found")
        if len(req.documents) > self.settings.max_documents:
            raise bad(f"The request has {len(req.documents)} documents; this server takes at most "
                      f"{self.settings.max_documents} (--max-documents). Join short ones, or send fewer.", "documents")
        mode = req.mode or self.settings.default_mode
        max_new = req.sampling.max_tokens or self.settings.default_max_tokens
        try:
            lease = self.quotas.admit(tenant, sum(len(d.chunk_text.encode("utf-8", "surrogatepass"))
                                                  for d in req.documents))
        except APIError as e:
            self.metrics.tenant_refused.labels(tenant.name, e.code).inc()
            raise
        try:
            prepared, ticket = await self._prepare_and_submit(req, tenant, mode, max_new, lease)
        except BaseException:
            lease.cancel()
            raise
        lease.started(ticket)
        return prepared, ticket

    async def admit_choices(self, req: GenerationRequest, tenant: Tenant = ANONYMOUS) -> list:
        """``admit`` for each of the request's ``n`` choices: [(prepared prompt, ticket)], choice i
        sampled with seed + i (so that a seeded request's choices differ, and repeat). All or none:
        a choice refused cancels those admitted before it."""
        if req.n > self.settings.max_queue:
            raise bad(f"'n' is {req.n}, more than this server's queue takes at once ({self.settings.max_queue}, "
                      "--max-queue); ask for fewer choices.", "n")
        admitted = []
        try:
            for i in range(req.n):
                r = req if i == 0 or req.sampling.seed is None else \
                    replace(req, sampling=replace(req.sampling, seed=req.sampling.seed + i))
                admitted.append(await self.admit(r, tenant))
        except BaseException:
            for _, ticket in admitted:
                self.driver.cancel(ticket)
            raise
        return admitted

    async def _prepare_and_submit(self, req: GenerationRequest, tenant: Tenant, mode: str, max_new: int, lease):
        s = req.sampling
        try:
            # retrieval embeds the question and span matching tokenizes: off the event loop
            prepared = await asyncio.to_thread(self.builder.build, req, mode, tenant.cache_salt)
            prepared.segments = self.public_documents.mark(prepared.segments)
            try:
                lease.reserve_tokens(prompt_tokens(prepared.segments) + max_new)
            except APIError as e:
                self.metrics.tenant_refused.labels(tenant.name, e.code).inc()
                raise
            ticket = await self.driver.submit(prepared.segments, uses_index=prepared.uses_index, mode=mode,
                                              max_new_tokens=max_new, temperature=s.temperature, top_p=s.top_p,
                                              stop=list(s.stop), seed=s.seed, recovery=prepared.recovery,
                                              cache_salt=tenant.cache_salt, tenant=tenant.name,
                                              output_format=req.output_format or (req.tools and
                                                                                  req.tools.output_format),
                                              presence_penalty=s.presence_penalty,
                                              frequency_penalty=s.frequency_penalty, logprobs=req.logprobs)
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

    def finished(self, req: GenerationRequest, rid: str, result, tenant: Tenant = ANONYMOUS) -> None:
        st = result.stats
        self.metrics.observe(st, tenant.name)
        # the messages or prompt with --log-prompts, never the documents (nor their sizes per document)
        text = f" prompt={req.messages or req.prompt!r}" if self.settings.log_prompts else ""
        log.info("%s %s tenant=%s mode=%s prompt_tokens=%d cached=%d new=%d ttft_ms=%.1f total_ms=%.1f finish=%s%s",
                 rid, req.kind, tenant.name, st.mode, st.prompt_tokens, st.cached_tokens, st.new_tokens, st.ttft_ms,
                 st.total_ms, result.finish_reason, text)


def open_engine(model, index, settings: ServerSettings):
    """(driver, model, index, the prompt builder's tokenizer) for a ``LazyLLM`` or an ``EngineSpec``,
    or for engines served elsewhere: an object with ``open_driver(settings)`` returning those
    four (the Ray Serve ingress's ``scaleout.serve_driver.ServeEngines``)."""
    if hasattr(model, "open_driver"):
        return model.open_driver(settings)
    if isinstance(model, EngineSpec) and index is not None:
        raise LazyRagError("With an EngineSpec, name the index in it (EngineSpec(index_dir=...)), not as the "
                           "index argument.")
    if not settings.engine_process:
        if isinstance(model, EngineSpec):
            model, index = model.load()
        source = None if index is None else index.chunk_source
        # the builder's own tokenizer: the engine decodes with the original during steps
        return EngineDriver(model.engine, settings.max_queue, source), model, index, copy.deepcopy(model.tokenizer)
    spec = model if isinstance(model, EngineSpec) else EngineSpec.from_llm(model, index)
    driver = ProcessDriver(spec, settings.max_queue, settings.engine_restart)
    try:
        if isinstance(model, EngineSpec):  # this process loads no weights: the tokenizer and the index only
            remote = RemoteModel(spec.load_tokenizer(), driver.info)
            index = spec.load_index(remote) if spec.index_dir else None
        else:  # loaded already (its index too); the caller may still generate with its tokenizer
            remote = RemoteModel(copy.deepcopy(model.tokenizer), driver.info)
        return driver, remote, index, remote.tokenizer
    except BaseException:
        driver.close()
        raise


def unavailable(e: EngineUnavailableError) -> APIError:
    return APIError(503, str(e), type="server_error", code="engine_unavailable", headers={"Retry-After": "5"})


def failed(e: LazyRagError) -> APIError:
    """A request that failed inside the engine, after admission."""
    if isinstance(e, EngineUnavailableError):
        return unavailable(e)
    if isinstance(e, ClientGoneError):  # nobody reads this answer; 499 as nginx logs it, for the metrics
        return APIError(499, str(e), type="server_error", code="client_closed_request")
    return APIError(500, str(e), type="server_error", code="request_failed")


def prompt_tokens(segments) -> int:
    """Tokens of a prompt whose segments are token ids (``PromptBuilder.build``'s)."""
    return sum(len(seg.content) if isinstance(seg, Chunk) else len(seg) for seg in segments)


def usage(results) -> dict:
    """OpenAI's usage of a request's choices (its results): the prompt counted once (as OpenAI
    counts it for n choices), the completion tokens of all of them."""
    first = results[0].stats
    new = sum(r.stats.new_tokens for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": new, "total_tokens": first.prompt_tokens + new,
            "prompt_tokens_details": {"cached_tokens": first.reused_tokens}}


def lazy_rag_extra(result, prepared) -> dict:
    """lazy-rag's own response field: how the prompt was served (retrieved sources go in ``sources``)."""
    st = result.stats
    return {"mode": st.mode, "recovery": st.recovery, "ttft_ms": round(st.ttft_ms, 2),
            "total_ms": round(st.total_ms, 2), "cached_tokens": st.cached_tokens, "reused_tokens": st.reused_tokens,
            "encoded_tokens": st.encoded_tokens,
            "computed_tokens": st.computed_tokens, "chunk_sources": st.chunk_sources,
            "matched_chunks": prepared.matched_chunks, "reuse_risk": st.reuse_risk,
            "first_token_entropy": st.first_token_entropy, "recomputed_tokens": st.recomputed_tokens,
            "served_again": st.served_again, "recovery_applied": st.recovery_applied}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(model, index=None, settings: ServerSettings | None = None) -> FastAPI:
    """``model``: a loaded ``LazyLLM`` (``index``: a ``LazyIndex`` over it) or an ``EngineSpec``
    (see ``LazyRagServer``)."""
    server = LazyRagServer(model, index, settings)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.driver.close()

    app = FastAPI(title="lazy-rag", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimits, max_bytes=server.settings.max_body_bytes,
                       timeout_s=server.settings.client_timeout_s)

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
        except RecursionError:
            raise bad("The request body nests JSON arrays or objects too deeply.") from None

    # -- health ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not server.driver.alive:
            status = "engine_restarting" if server.driver.restarting else "engine_unavailable"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ready", "model": server.settings.model_name}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/info")
    async def info(request: Request):
        server.check_auth(request)  # the model, the device and the index's path: not for anyone without a key
        return server.info()

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model",
                                            "created": server.started, "owned_by": "lazy-rag",
                                            "max_model_len": server.llm.context_window}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        texts, fmt = parse_embeddings(await read_json(request),
                                      (server.embeddings.name, server.settings.model_name))
        return await asyncio.to_thread(server.embeddings.embed, texts, fmt)

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
        tenant = request.state.tenant
        admitted = await server.admit_choices(req, tenant)
        head = {"id": rid, "object": obj, "created": created, "model": server.settings.model_name}
        if req.stream:
            return StreamingResponse(stream(req, rid, head, admitted, tenant), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        tickets = [t for _, t in admitted]
        watch = asyncio.create_task(cancel_on_disconnect(request, tickets))
        reads = [asyncio.create_task(whole_text(t)) for t in tickets]
        try:
            texts = await asyncio.gather(*reads)
        except LazyRagError as e:
            raise failed(e) from None
        finally:
            watch.cancel()
            for task in reads:
                task.cancel()  # a choice that failed ends the others (their requests are cancelled)
        choices = []
        for i, (text, ticket) in enumerate(zip(texts, tickets)):
            result = ticket.result
            server.finished(req, rid, result, tenant)
            lp = logprobs_of(req, ticket.logprobs)
            if req.kind == "chat":
                message = whole_message(req.tools, text)
                finish = "tool_calls" if message.get("tool_calls") and result.finish_reason == "stop" \
                    else result.finish_reason
                choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": lp})
            else:
                choices.append({"index": i, "text": text, "finish_reason": result.finish_reason, "logprobs": lp})
        prepared, first = admitted[0][0], tickets[0].result
        body = {**head, "choices": choices, "usage": usage([t.result for t in tickets]),
                "lazy_rag": lazy_rag_extra(first, prepared)}
        if req.rag_top_k:
            body["sources"] = prepared.sources
        return body

    async def whole_text(ticket) -> str:
        return "".join([p async for p in server.driver.pieces(ticket)])

    def logprobs_of(req: GenerationRequest, entries: list, offset: int = 0):
        """OpenAI's logprobs of ``entries`` ((id, logprob, top [(id, logprob)]) per token): chat's
        ``{"content": [...]}``, the legacy completions' ``{"tokens", "token_logprobs", ...}``
        (``offset``: the text already sent, for ``text_offset``); None without logprobs."""
        if req.logprobs is None:
            return None
        texts = server.builder.token_texts([i for e in entries for i in (e[0], *(t for t, _ in e[2]))])
        at = iter(texts)
        rows = [(next(at), lp, [(next(at), tlp) for _, tlp in top]) for _, lp, top in entries]
        if req.kind == "chat":
            def one(text, lp):
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "surrogatepass"))}

            return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]}
                                for t, lp, top in rows], "refusal": None}
        offsets = []
        for t, _, _ in rows:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(top) for _, _, top in rows], "text_offset": offsets}

    async def cancel_on_disconnect(request: Request, tickets) -> None:
        """A client that goes away before a (non-streamed) answer is done frees its requests."""
        while not all(t.finished for t in tickets):
            if await request.is_disconnected():
                for t in tickets:
                    server.driver.cancel(t)
                return
            await asyncio.sleep(0.25)

    async def stream(req: GenerationRequest, rid: str, head: dict, admitted: list, tenant: Tenant):
        """The choices' events as they come (with n > 1, the choices' chunks interleave, each naming
        its index); each choice's last chunk carries its finish_reason and its lazy_rag stats, and
        with include_usage a last chunk the usage of all of them."""
        chunk = {**head, "object": f"{head['object']}.chunk"} if req.kind == "chat" else dict(head)
        events: asyncio.Queue = asyncio.Queue()

        async def one_choice(i: int, prepared, ticket):
            sent_lp, text_at = 0, 0
            tools = ToolCallStream(req.tools) if req.tools is not None else None

            def choice(deltas: list[dict], finish: str | None = None) -> list[dict]:
                nonlocal sent_lp, text_at
                entries, sent_lp = ticket.logprobs[sent_lp:], len(ticket.logprobs)
                lp = logprobs_of(req, entries, text_at) if entries else None
                if lp is not None and req.kind == "completion":
                    text_at += sum(len(t) for t in lp["tokens"])
                if req.kind == "chat":
                    deltas = deltas or ([{}] if finish or entries else [])
                    return [{"index": i, "delta": d, "finish_reason": finish if k == len(deltas) - 1 else None,
                             "logprobs": lp if k == 0 else None} for k, d in enumerate(deltas)]
                text = "".join(d.get("content", "") for d in deltas)
                return [{"index": i, "text": text, "finish_reason": finish, "logprobs": lp}] \
                    if text or finish or entries else []

            if req.kind == "chat":
                await events.put({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": None, "logprobs": None}]})
            async for piece in server.driver.pieces(ticket):
                for c in choice(tools.feed(piece) if tools else [{"content": piece}]):
                    await events.put({**chunk, "choices": [c]})
            result = ticket.result
            server.finished(req, rid, result, tenant)
            finish = result.finish_reason
            rest = tools.finish() if tools else []
            if tools is not None and tools.is_call and finish == "stop":
                finish = "tool_calls"
            last = choice(rest, finish)
            for c in last[:-1]:
                await events.put({**chunk, "choices": [c]})
            end = {**chunk, "choices": last[-1:], "lazy_rag": lazy_rag_extra(result, prepared)}
            if req.rag_top_k:
                end["sources"] = prepared.sources
            await events.put(end)

        async def run_choice(i, prepared, ticket):
            try:
                await one_choice(i, prepared, ticket)
            except LazyRagError as e:  # failed inside the engine after the headers went out
                await events.put(e)
            finally:
                await events.put(None)

        tasks = [asyncio.create_task(run_choice(i, p, t)) for i, (p, t) in enumerate(admitted)]
        try:
            running = len(tasks)
            while running:
                event = await events.get()
                if event is None:
                    running -= 1
                elif isinstance(event, LazyRagError):
                    yield _sse(failed(event).body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield _sse(event)
            if req.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage([t.result for _, t in admitted])})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:  # the client left, or a choice failed: the others' requests are cancelled
                task.cancel()

    # -- the web page ---------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
