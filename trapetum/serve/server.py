"""OpenAI-compatible HTTP server (FastAPI + uvicorn) and the web page at ``/``.

    app = create_app([ModelSpec("model.cbk"), ModelSpec(None)], api_key=None, max_waiting=64)
    run(specs, host="127.0.0.1", port=8000)            # what ``trapetum serve`` calls

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming),
``GET /v1/models[/{id}]``, ``GET /health`` (503 while loading), ``GET /`` (chat + compare page).

Threads: uvicorn's event loop answers HTTP; each engine ``Worker`` (worker.py) owns its models on
its own thread. Models given the same device share one worker, so they take turns and their
speeds are honest; models on different devices get a worker each and run at the same time.
Tokenizing for the context check happens before the queue, on a small thread pool of the model's own
(so a prompt that cannot fit is refused at once, and a model whose chat template is slow or hostile holds
only its own pool: other models, ``/health`` and the event loop keep answering). A chat request's token ids
are computed there once and handed to the engine, which never renders a template.

Errors a model's chat template causes (it is code from the model file, rendered under limits by
``trapetum/chat_template.py``): its own ``raise_exception`` refusing the messages is the client's 400
(``param: "messages"``, ``code: "chat_template_rejected"``); any other failure (an exception, a timeout,
too much memory or output, a template that does not compile) is the model file's fault and answers 422 with
``type: "server_error"``, ``code: "chat_template_error"``, ``param: null`` and a message naming the model's
template: 4xx, so that OpenAI clients do not retry a failure that will repeat; never a 500.

Network guards (``guards.py``): Host allow-list on loopback binds, Origin check for browser requests, JSON
content type on POSTs (415 otherwise), header and body read timeouts. ``/v1/models`` shows model ids and
file names, never a path of this machine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat_template import ChatTemplateError
from ..errors import TrapetumError
from . import defaults as D
from . import protocol as P
from .guards import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, BodyLimit, HostGuard
from .protocol import APIError
from .worker import Job, NotReady, QueueFull, Worker

log = logging.getLogger("trapetum.serve")
STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0                  # SSE comment while a streamed request waits in the queue
DEFAULT_MAX_BODY = 1 << 20          # 1 MiB: ~250k tokens of text, far past any context we serve
TOKENIZER_THREADS = 2               # per model: prompt tokenizing and chat-template rendering
SETTINGS_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
                   "ignore_eos", "max_new_tokens")


@dataclass
class ModelSpec:
    """One model to serve: ``path`` (None = the embedded default), optional ``alias`` (the id in
    the API), ``device``, ``draft_kw`` (speculative decoding: ``trapetum.load``'s draft options; the model is then
    also served plainly as ``NAME:plain``), ``max_context`` (``--ctx``) and ``sparsity`` (``trapetum.load``'s
    activation sparsity: "on" or a side file; None: dense). ``loader`` replaces ``trapetum.load`` (tests, embedding)."""
    path: str | None = None
    alias: str | None = None
    device: str | None = None
    loader: Callable[[], Any] | None = None
    draft_kw: dict = field(default_factory=dict)
    max_context: int | None = None
    sparsity: str | None = None
    gpu_mem: float | None = None  # ``trapetum.load``'s GPU memory budget (--gpu-mem), GB
    options: Any = None  # ``trapetum.load``'s Options (serve's kernel flags), None: from the environment

    def load(self) -> tuple[str | None, Any]:
        if self.loader is not None:
            return self.alias, self.loader()
        import trapetum
        kw = {k: v for k, v in (("device", self.device), ("max_context", self.max_context)) if v is not None}
        if self.sparsity is not None:
            kw["sparsity"] = self.sparsity
        if self.gpu_mem is not None:
            kw["gpu_mem"] = self.gpu_mem
        if self.options is not None:
            kw["options"] = self.options
        return self.alias, trapetum.load(self.path, **kw, **self.draft_kw)

    @staticmethod
    def parse(text: str, device: str | None = None, draft_kw: dict | None = None,
              max_context: int | None = None) -> "ModelSpec":
        """``PATH`` or ``ALIAS=PATH`` (``default`` or ``-`` = the embedded default model)."""
        alias = None
        if "=" in text and not os.path.exists(text):
            a, p = text.split("=", 1)
            if a and all(c.isalnum() or c in "._-:" for c in a):
                alias, text = a, p
        path = None if text in ("", "-", "default") else text
        return ModelSpec(path=path, alias=alias, device=device, draft_kw=dict(draft_kw or {}), max_context=max_context)


class Registry:
    """Model name -> (worker, model); filled as workers finish loading."""

    def __init__(self, sampling: dict | None = None):
        self.sampling = dict(sampling or {})   # serve's --temperature etc. (defaults.py)
        self.defaults: dict[str, dict] = {}     # model name -> the sampling defaults of its requests
        self.lock = threading.Lock()
        self.names: list[str] = []          # claimed so far
        self.order: dict[str, int] = {}     # name -> position of its MODEL argument
        self.owner: dict[str, Worker] = {}
        self.info: dict[str, dict] = {}
        self.pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self.pending: dict[str, int] = {}

    def pool(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        """The model's own tokenizing threads (created on first use)."""
        with self.lock:
            ex = self.pools.get(name)
            if ex is None:
                ex = self.pools[name] = concurrent.futures.ThreadPoolExecutor(
                    TOKENIZER_THREADS, thread_name_prefix=f"trapetum-tok-{name}"[:40])
            return ex

    def close(self) -> None:
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
        for ex in pools:
            ex.shutdown(wait=False, cancel_futures=True)

    def claim(self, want: str) -> str:
        with self.lock:
            name, i = want, 2
            while name in self.names:
                name, i = f"{want}-{i}", i + 1
            self.names.append(name)
            return name

    def loader(self, i: int, spec: ModelSpec, reserved: str | None) -> Callable[[], tuple[str, Any]]:
        """Load ``spec`` and name it: its alias (claimed up front, so aliases never depend on which
        engine finishes first) or the model's own name made unique."""
        def load():
            _, m = spec.load()
            own = str(getattr(m, "name", None) or "model")      # a file name may hold undecodable bytes
            own = own.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            name = reserved or self.claim(own)
            with self.lock:
                self.order[name] = i
            return name, m
        return load

    def listed(self) -> list[str]:
        """Ready models in command-line order."""
        with self.lock:
            return sorted((n for n in self.names if n in self.owner), key=lambda n: self.order.get(n, 1 << 30))

    def ready(self, w: Worker) -> None:
        try:    # import once here, on the engine thread, not in the first request's handler
            from ..api import GenerationSettings  # noqa: F401
        except ImportError:
            pass
        for name, m in w.models.items():
            info = _model_info(m)
            defaults = D.sampling_defaults(m, self.sampling)
            info["sampling_defaults"] = D.describe(defaults, m, self.sampling)
            with self.lock:
                self.defaults[name] = defaults
                self.owner[name] = w
                self.info[name] = info
        print(f"trapetum: ready: {', '.join(w.models)} ({w.name}, loaded in {w.load_s:.1f} s)",
              flush=True)


def _model_info(m) -> dict:
    info: dict[str, Any] = {}
    try:
        info = dict(m.info())
    except Exception as e:  # noqa: BLE001 -- info is decoration; a failure must not stop serving
        info = {"error": f"info() failed: {e}"}
    info.setdefault("context_size", getattr(m, "context_size", None))
    if getattr(m, "path", None) is not None:
        info.setdefault("path", str(m.path))
    return _no_paths(_jsonable(info))


def _no_paths(x):
    """``x`` with every absolute path replaced by its file name (the API does not show this machine's paths)."""
    if isinstance(x, dict):
        return {k: _no_paths(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_paths(v) for v in x]
    if isinstance(x, str) and (os.path.isabs(x) or x.startswith("~")):
        return Path(x).name
    return x


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _error_response(e: APIError) -> Response:
    return Response(e.content(), status_code=e.status, headers=e.headers, media_type="application/json")


class _Channel:
    """Carries a job's events from the engine thread onto the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()

    def sink(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, (kind, payload))


def create_app(specs: list[ModelSpec], *, api_key: str | None = None, max_waiting: int = 64,
               max_body: int = DEFAULT_MAX_BODY, threads: int | None = None,
               cors_origins: list[str] | None = None, allowed_hosts: set[str] | None = None,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, sampling: dict | None = None,
               batch: dict | None = None) -> FastAPI:
    """Build the ASGI app; engines start (and load their models) when the app starts.
    ``threads``: torch CPU threads per engine (None: torch's default); ``cors_origins``: web
    origins allowed to call the API from a browser (the page at / needs none); ``allowed_hosts``: the
    Host names answered (None: any; ``run`` sets the loopback names for a loopback bind); ``sampling``: the
    defaults of requests that leave a field out, over the model's own (defaults.py); ``batch``: the batch
    scheduler's options (``Model.batch_scheduler``: max_batch, kv_blocks, kv_mem; None: one request at a time)."""
    if not specs:
        specs = [ModelSpec()]
    registry = Registry(sampling)
    groups: dict[str, list] = {}
    for i, s in enumerate(specs):
        reserved = registry.claim(s.alias) if s.alias else None
        groups.setdefault(s.device or "default", []).append(registry.loader(i, s, reserved))
    init = None
    if threads is not None:
        def init():
            import torch
            torch.set_num_threads(threads)
    workers = [Worker(g, max_waiting=max_waiting, name=f"engine-{dev}", claim=lambda n: n, init=init, batch=batch)
               for dev, g in groups.items()]
    for w in workers:
        w.on_ready = registry.ready

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for w in workers:
            w.start()
        try:
            yield
        finally:
            for w in workers:
                await run_in_threadpool(w.stop, 3.0)
            registry.close()

    app = FastAPI(title="Trapetum", version=P.SYSTEM_FINGERPRINT, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.workers = workers
    app.state.registry = registry
    app.add_middleware(BodyLimit, max_body=max_body, body_timeout_s=body_timeout_s)
    app.add_middleware(HostGuard, allowed_hosts=allowed_hosts, origins=cors_origins)
    if cors_origins:                  # added last = outermost: errors (401, 413, 429) carry the headers too
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"],
                           expose_headers=["Retry-After"])

    # ------------------------------------------------------------------ errors, all in OpenAI's shape
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"Unknown URL: {request.method} {request.url.path}",
               405: f"Method {request.method} is not allowed for {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error_response(APIError(e.status_code, msg, code="not_found" if e.status_code == 404 else None,
                                        headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        errs = e.errors()
        loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return _error_response(APIError(400, "; ".join(er.get("msg", "") for er in errs) or "Invalid request.",
                                        param=loc or None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, f"Internal server error ({type(e).__name__}).", type="server_error"))

    # ------------------------------------------------------------------ helpers
    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        h = request.headers.get("authorization", "")
        given = h[7:].strip() if h[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'.",
                           type="invalid_request_error", code="invalid_api_key")

    def loading_error() -> APIError:
        failed = [w for w in workers if w.state == "failed"]
        if failed:
            return APIError(503, f"Model loading failed: {failed[0].error}", code="model_load_failed")
        return APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                        headers={"Retry-After": "1"})

    def resolve(name: str | None) -> tuple[str, Worker, Any]:
        if name is None or name == "":
            ready = registry.listed()
            if not ready:
                raise loading_error()
            name = ready[0]
        w = registry.owner.get(name)
        if w is None:
            if any(x.state == "loading" for x in workers):
                raise loading_error()
            raise APIError(404, f"The model '{name}' does not exist. Served models: "
                           f"{', '.join(registry.listed()) or 'none'}.", param="model", code="model_not_found")
        return name, w, w.models[name]

    async def read_body(request: Request) -> dict:
        ct = request.headers.get("content-type", "")
        media = ct.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            shown = " ".join(ct.split())[:60] or "none"
            raise APIError(415, f"Unsupported Content-Type '{shown}': send the request body as JSON with "
                           "'Content-Type: application/json'.", code="unsupported_media_type")
        return P.parse_json_body(await request.body())

    def validate_settings(settings: dict) -> None:
        try:
            from ..api import GenerationSettings
        except ImportError:
            return
        try:
            GenerationSettings(**settings).validate()
        except TrapetumError as e:
            msg = str(e)
            param = next((f for f in SETTINGS_FIELDS if f in msg), None)
            if param == "max_new_tokens":
                param = "max_tokens"
            raise APIError(400, msg, param=param) from None

    def template_error(name: str, e: ChatTemplateError) -> APIError:
        if e.rejected:
            return APIError(400, f"The chat template of model '{name}' refused the messages: {e.reason}",
                            param="messages", code="chat_template_rejected")
        if e.reason == "this model has no chat template":
            return APIError(400, f"The model '{name}' has no chat template; use /v1/completions with a prompt.",
                            param="model", code="no_chat_template")
        log.warning("model %s: chat template failed: %s", name, e.reason)
        return APIError(422, f"The chat template of model '{name}' failed: {e.reason}. This is a fault of the "
                        "model's file, not of the request: the server's operator must fix or replace the template.",
                        type="server_error", code="chat_template_error")

    async def tokenize(name: str, fn, arg):
        """``fn(arg)`` on the model's own tokenizing threads (at most ``max_waiting`` waiting: 429 past it)."""
        with registry.lock:
            if registry.pending.get(name, 0) >= max_waiting + TOKENIZER_THREADS:
                raise APIError(429, f"The server is busy: too many requests for model '{name}' are being "
                               "tokenized. Retry in about 1 s.", code="queue_full", headers={"Retry-After": "1"})
            registry.pending[name] = registry.pending.get(name, 0) + 1
        try:
            return await asyncio.get_running_loop().run_in_executor(registry.pool(name), fn, arg)
        finally:
            with registry.lock:
                registry.pending[name] -= 1

    async def prepare(name: str | None, req: P.GenRequest, kind: str, inputs) -> tuple[str, Worker, int, dict, Any]:
        """(model name, worker, prompt tokens, settings, what the engine gets: a chat's token ids, else inputs)."""
        name, w, model = resolve(name)
        engine_inputs = inputs
        try:
            if kind == "chat":
                engine_inputs = list(await tokenize(name, model.encode_chat, inputs))
                n_prompt = len(engine_inputs)
            elif isinstance(inputs, list):
                n_prompt = len(inputs)
            else:
                n_prompt = await tokenize(name, model.count_tokens, inputs)
        except ChatTemplateError as e:
            raise template_error(name, e) from None
        except TrapetumError as e:
            raise APIError(400, str(e), param="messages" if kind == "chat" else "prompt") from None
        where = "messages" if kind == "chat" else "prompt"
        if n_prompt == 0:
            raise APIError(400, f"The {where} encode to no tokens.", param=where)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(inputs, list) and kind == "text" and isinstance(vocab, int) and max(inputs) >= vocab:
            raise APIError(400, f"Invalid 'prompt': token id {max(inputs)} is out of range for this model's "
                           f"vocabulary of {vocab} tokens.", param="prompt")
        if kind == "chat" and isinstance(vocab, int) and max(engine_inputs) >= vocab:
            raise APIError(422, f"The tokenizer of model '{name}' produced token id {max(engine_inputs)}, outside "
                           f"its vocabulary of {vocab}: a fault of the model's file.", type="server_error",
                           code="tokenizer_error")
        ctx = int(model.context_size)
        defaults = registry.defaults.get(name, D.BUILTIN)
        if req.max_tokens is None:
            if n_prompt >= ctx:
                raise P.context_error(ctx, n_prompt, 1, where=where)
            max_new = min(ctx - n_prompt, defaults.get("max_new_tokens", ctx))
        else:
            max_new = req.max_tokens
            if n_prompt + max_new > ctx:
                raise P.context_error(ctx, n_prompt, max_new, where=where)
        settings = {**{k: v for k, v in defaults.items() if k != "max_new_tokens"}, **req.settings,
                    "max_new_tokens": max_new}
        validate_settings(settings)
        return name, w, n_prompt, settings, engine_inputs

    def submit(w: Worker, job: Job) -> None:
        try:
            w.submit(job)
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e.waiting} requests are queued (limit {w.max_waiting}). "
                           f"Retry in about {e.retry_after_s} s.", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except NotReady:
            raise loading_error() from None

    async def generate(request: Request, req: P.GenRequest, kind: str, inputs):
        name, w, n_prompt, settings, engine_inputs = await prepare(req.model, req, kind, inputs)
        too_big = w.check_fits(name, n_prompt, settings["max_new_tokens"])
        if too_big:
            raise APIError(400, too_big, param="max_tokens", code="kv_cache_too_small")
        ch = _Channel()
        # a chat is handed over as its token ids: the engine thread runs no template
        job = Job(model=name, kind="text", inputs=engine_inputs, settings=settings, sink=ch.sink)
        submit(w, job)
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        created = P.now()
        if req.stream:
            return StreamingResponse(_stream(ch, job, rid, name, created, kind, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _wait(request, ch, job, rid, name, created, kind)

    async def _wait(request, ch, job, rid, name, created, kind):
        async def watch():            # the client hanging up cancels the job (streams: Starlette does this)
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel.set()

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                ev, payload = await ch.q.get()
                if ev == "done":
                    if watcher.done():
                        return Response(status_code=499)     # nobody is listening
                    make = P.chat_response if kind == "chat" else P.completion_response
                    return JSONResponse(make(rid, name, created, payload, job.queue_s))
                if ev == "error":
                    raise _engine_error(payload)
        finally:
            watcher.cancel()
            job.cancel.set()

    async def _stream(ch, job, rid, name, created, kind, include_usage):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text=None, finish=None, delta=None):
            if kind == "chat":
                d = delta if delta is not None else ({} if text is None else {"content": text})
                return P.sse(P.chat_chunk(rid, name, created, d, finish, with_usage_field=include_usage))
            return P.sse(P.completion_chunk(rid, name, created, text or "", finish, with_usage_field=include_usage))

        getter = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(ch.q.get())
                done, _ = await asyncio.wait({getter}, timeout=KEEPALIVE_S)
                if not done:              # long queue wait: an SSE comment keeps proxies from timing out
                    yield b": keep-alive\n\n"
                    continue
                ev, payload = getter.result()
                getter = None
                if ev == "start":
                    if kind == "chat":
                        yield chunk(delta={"role": "assistant", "content": ""})
                elif ev == "token":
                    if payload.text:
                        yield chunk(payload.text)
                elif ev == "done":
                    yield chunk(finish=payload.finish_reason)
                    if include_usage:
                        yield P.sse(P.usage_chunk(rid, name, created, obj, payload, job.queue_s))
                    yield P.sse("[DONE]")
                    return
                elif ev == "error":
                    yield P.sse(_engine_error(payload).body())
                    yield P.sse("[DONE]")
                    return
        finally:
            if getter is not None:
                getter.cancel()
            job.cancel.set()      # client gone (the task is cancelled) or finished: free the engine

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        snaps = [w.snapshot() for w in workers]
        states = {s["state"] for s in snaps}
        status = "ok" if states == {"ready"} else ("error" if "failed" in states else "loading")
        body = {"status": status, "models": registry.listed(), "engines": snaps}
        if status == "error":
            body["error"] = next(w.error for w in workers if w.state == "failed")
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        names = registry.listed()
        return {"object": "list", "data": [P.model_object(n, created, {"info": registry.info[n]}) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        name, _, _ = resolve(model_id)
        return P.model_object(name, created, {"info": registry.info[name]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req = P.parse_chat_request(await read_body(request))
        return await generate(request, req, "chat", req.messages)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req = P.parse_completion_request(await read_body(request))
        return await generate(request, req, "text", req.prompt)

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    created = P.now()
    return app


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ChatTemplateError):    # not expected: the engine gets token ids (see prepare)
        return APIError(422, f"The model's chat template failed: {e.reason}", type="server_error",
                        code="chat_template_error")
    if isinstance(e, TrapetumError):
        return APIError(400, str(e))
    return APIError(500, f"Generation failed ({type(e).__name__}: {e}).", type="server_error")


def run(specs: list[ModelSpec], *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        max_waiting: int = 64, max_body: int = DEFAULT_MAX_BODY, log_level: str = "info",
        access_log: bool = True, threads: int | None = None, cors_origins: list[str] | None = None,
        allowed_hosts: list[str] | None = None, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, sampling: dict | None = None, note: str = "",
        batch: dict | None = None) -> None:
    """Serve until interrupted (what ``trapetum serve`` runs). ``allowed_hosts``: Host names answered besides
    the loopback names of a loopback bind (``guards.allowed_hosts_for``); ``sampling``: see create_app; ``note``:
    said after the address, once the socket is bound (listen.py: a port in use is a TrapetumError)."""
    import uvicorn

    from .guards import allowed_hosts_for, header_timeout_protocol
    from .listen import bind, raise_fd_limit
    sock = bind(host, port)
    port = sock.getsockname()[1]  # the port bound (--port 0: one the system chose)
    raise_fd_limit()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)      # this thread (tokenizing helpers) and the default
    app = create_app(specs, api_key=api_key, max_waiting=max_waiting, max_body=max_body, threads=threads,
                     cors_origins=cors_origins, allowed_hosts=allowed_hosts_for(host, allowed_hosts),
                     body_timeout_s=body_timeout_s, sampling=sampling, batch=batch)
    shown = f"[{host}]" if ":" in host else host
    print(f"trapetum: serving on http://{shown}:{port}/ (OpenAI API at /v1, models load in the background; "
          f"GET /health is 200 once ready){note}", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=3, timeout_keep_alive=5,
                            http=header_timeout_protocol(header_timeout_s))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C: end every generation now, so open streams finish ("cancelled", then [DONE])
            # and their connections close, instead of being cut after the graceful timeout.
            for w in app.state.workers:
                w.cancel_all()
            super().handle_exit(sig, frame)

    server = Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:        # uvicorn re-raises the signal it handled
        pass
    finally:
        sock.close()
    if not server.started:
        raise TrapetumError(f"the server could not start on {shown}:{port} (see the message above)")
