"""The OpenAI-compatible HTTP API on rank 0 (FastAPI): completions, chat completions (the tokenizer's chat template),
streaming as server-sent events, models, health and Prometheus metrics.

A request passes the gate first (serving/http_gate.py: key, media type, body size), then FastAPI validates its body
against the schemas of serving/requests.py (its 422 answered as OpenAI's 400).  Tokenizing runs on a worker thread,
never on the event loop.  Each request is handed to the engine (serving/engine.py), whose thread calls back after
every step that changed it; the callback snapshots what is new and posts it to the request's asyncio queue, so the
engine's state is read only on its own thread.  A client that goes away is aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from autotp.serving.choices import Request
from autotp.serving.http_gate import ApiError, RequestGate
from autotp.serving.requests import ChatRequest, CompletionRequest, SamplingRequest
from autotp.serving.scheduler import Refused

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
COUNTERS = ("generation_tokens", "preemptions")


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400: one problem, naming its field.  Of a union's (a prompt is a string or a list),
    the one that says most: a check of ours, then a range or length, then a wrong type."""
    errors = exc.errors()
    first = min(errors, key=lambda e: (e.get("type") != "value_error", str(e.get("type")).endswith("_type")))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = field_path(first.get("loc", ())[1:])
    if not param:
        return ApiError(400, "the request body must be a JSON object")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: {param}", param=param)
    return ApiError(400, f"{param}: {first['msg'].removeprefix('Value error, ')}", param=param)


def field_path(location: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content': up to the first part that names a union's member,
    not a field."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}" if path else part
        else:
            break
    return path


def _snapshot(request: Request) -> dict:
    """What changed since the last snapshot (called on the engine's thread)."""
    choices = []
    for c in request.choices:
        sent = getattr(c, "logprobs_sent", 0)
        choices.append(
            {
                "index": c.index,
                "text": c.delta(),
                "logprobs": c.logprobs[sent:],
                "finish_reason": c.finish_reason,
                "tokens": len(c.sequence.output),
            }
        )
        c.logprobs_sent = len(c.logprobs)
    return {"choices": choices, "error": request.error, "finished": request.finished}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Api:
    """The endpoints' work, over one engine and its tokenizer."""

    def __init__(self, engine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name

    def check(self, request: SamplingRequest) -> None:
        if self.engine.error is not None:
            raise ApiError(503, self.engine.error)
        if request.model not in (None, self.model_name):
            raise ApiError(
                404,
                f"model {request.model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
            )
        unsupported = request.unsupported()
        if unsupported:
            raise ApiError(
                400,
                f"{unsupported}: autotp serve does not support this field; send it at its default or leave it out",
                param=unsupported,
            )

    async def completion_prompt(self, request: CompletionRequest) -> list[int]:
        try:
            prompt = request.one_prompt()
        except Refused as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
        if isinstance(prompt, str):
            prompt = (await run_in_threadpool(self.tokenizer, prompt, add_special_tokens=True))["input_ids"]
        if any(t < 0 or t >= self.engine.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {self.engine.vocab_size})", param="prompt")
        return prompt

    async def chat_prompt(self, request: ChatRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"{self.model_name}'s tokenizer has no chat template: use /v1/completions")
        try:
            conversation = request.conversation()
        except Refused as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        prompt = await run_in_threadpool(
            self.tokenizer.apply_chat_template,
            conversation,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(prompt)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def logprobs_of(self, items: list, chat: bool) -> dict:
        text = self.token_text
        if chat:
            return {
                "content": [
                    {
                        "token": text(t),
                        "logprob": lp,
                        "bytes": list(text(t).encode()),
                        "top_logprobs": [
                            {"token": text(i), "logprob": v, "bytes": list(text(i).encode())} for i, v in top
                        ],
                    }
                    for t, lp, top in items
                ]
            }
        return {
            "tokens": [text(t) for t, _, _ in items],
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [{text(i): v for i, v in top} for _, _, top in items],
        }

    async def serve(self, http: HttpRequest, prompt: list, request: SamplingRequest, chat: bool):
        """Run ``request`` on ``prompt``: one JSON answer, or its server-sent events when it streams."""
        try:
            sampling = request.sampling_for(max(1, self.engine.scheduler.max_model_len - len(prompt)))
        except Refused as exc:  # a value in OpenAI's range that autotp does not serve; the message starts with its name
            field = str(exc).split()[0]
            raise ApiError(400, str(exc), param=field if field in type(request).model_fields else None) from exc
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        work = Request(prompt, sampling, lambda r: loop.call_soon_threadsafe(queue.put_nowait, _snapshot(r)))
        try:
            self.engine.submit(work)
        except Refused as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
        except RuntimeError as exc:
            raise ApiError(503, str(exc)) from exc
        reply = Reply(self, http, work, queue, len(prompt), chat)
        if request.stream:
            return StreamingResponse(reply.events(request.include_usage), media_type="text/event-stream")
        return JSONResponse(await reply.whole())


class Reply:
    """One request's answer as it arrives from the engine: whole, or streamed."""

    def __init__(
        self, api: Api, http: HttpRequest, work: Request, queue: asyncio.Queue, prompt_tokens: int, chat: bool
    ):
        self.api, self.http, self.work, self.queue, self.chat = api, http, work, queue, chat
        self.prompt_tokens = prompt_tokens
        self.logprobs = work.sampling.logprobs is not None
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": api.model_name,
        }
        self.done: dict = {}  # index -> the choice's last snapshot

    def usage(self) -> dict:
        out = sum(c["tokens"] for c in self.done.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out, "total_tokens": self.prompt_tokens + out}

    async def updates(self):
        """The request's snapshots until it finishes; aborted if the client leaves."""
        finished = False
        try:
            while not finished:
                try:
                    update = await asyncio.wait_for(self.queue.get(), 0.5)
                except TimeoutError:
                    if await self.http.is_disconnected():
                        return
                    continue
                if update["error"] is not None:
                    raise ApiError(503, update["error"])
                finished = update["finished"]
                for c in update["choices"]:
                    self.done[c["index"]] = c
                yield update
        finally:
            if not finished:
                self.api.engine.abort(self.work)

    async def whole(self) -> dict:
        texts: dict = {}
        logs: dict = {}
        async for update in self.updates():
            for c in update["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                logs.setdefault(c["index"], []).extend(c["logprobs"])
        choices = [
            {
                "index": i,
                "finish_reason": self.done[i]["finish_reason"],
                "logprobs": self.api.logprobs_of(logs[i], self.chat) if self.logprobs else None,
                **self._content(texts[i], whole=True),
            }
            for i in sorted(self.done)
        ]
        return {**self.head, "choices": choices, "usage": self.usage()}

    def _content(self, text: str, whole: bool) -> dict:
        if not self.chat:
            return {"text": text}
        return {"message": {"role": "assistant", "content": text}} if whole else {"delta": {"content": text}}

    async def events(self, include_usage: bool):
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if self.chat:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.work.sampling.n)
            ]
            yield _event({**head, "choices": first})
        try:
            async for update in self.updates():
                for c in update["choices"]:
                    if not c["text"] and not c["finish_reason"] and not c["logprobs"]:
                        continue
                    part = {
                        "index": c["index"],
                        "finish_reason": c["finish_reason"],
                        "logprobs": self.api.logprobs_of(c["logprobs"], self.chat) if self.logprobs else None,
                        **self._content(c["text"], whole=False),
                    }
                    yield _event({**head, "choices": [part]})
        except ApiError as exc:
            yield _event(exc.body)
            return
        if include_usage:
            yield _event({**head, "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


def metrics_text(figures: dict, histograms: dict) -> str:
    """Prometheus' text format; counters end in _total; the latency histograms (serving/latency_metrics.py)."""
    lines = []
    for name, value in figures.items():
        kind = "counter" if name in COUNTERS else "gauge"
        metric = f"autotp_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
    for name, histogram in histograms.items():
        lines += histogram.lines(f"autotp_{name}")
    return "\n".join(lines) + "\n"


def make_app(
    engine,
    tokenizer,
    *,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    app = FastAPI(title="autotp", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGate, max_body_bytes=max_request_bytes, api_key=api_key)
    api, created = Api(engine, tokenizer, model_name), int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: HttpRequest):
        api.check(request)
        return await api.serve(http, await api.completion_prompt(request), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: HttpRequest):
        api.check(request)
        return await api.serve(http, await api.chat_prompt(request), request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "autotp",
                    "max_model_len": engine.scheduler.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            metrics_text(engine.metrics(), engine.histograms()), media_type="text/plain; version=0.0.4"
        )

    return app
