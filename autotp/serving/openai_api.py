"""The OpenAI-compatible HTTP API on rank 0 (FastAPI): completions, chat completions (the tokenizer's chat template),
streaming as server-sent events, models, health and Prometheus metrics.

Each request is handed to the engine (serving/engine.py), whose thread calls back after every step that changed
it; the callback snapshots what is new and posts it to the request's asyncio queue, so the engine's state is read
only on its own thread.  A client that goes away is aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from autotp.serving.engine import Request, Sampling
from autotp.serving.scheduler import Refused


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def sampling_of(body: dict, room: int) -> Sampling:
    """The request's sampling fields, checked (Refused names the wrong one).  Without max_tokens a completion makes
    16 tokens (OpenAI's default) and a chat reply runs to ``room``, the tokens its sequence has left."""
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    logprobs = body.get("logprobs")
    if body.get("messages") is not None:  # chat: logprobs is a flag, top_logprobs the count
        logprobs = (body.get("top_logprobs") or 0) if logprobs else None
    try:
        asked = body.get("max_tokens", body.get("max_completion_tokens"))
        return Sampling(
            max_tokens=asked if asked is not None else (room if "messages" in body else 16),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=max(0, int(body.get("top_k", 0))),
            seed=body.get("seed"),
            stop=stop,
            n=body.get("n", 1),
            logprobs=logprobs,
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except (TypeError, ValueError) as exc:
        raise Refused(str(exc)) from exc


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


def make_app(engine, tokenizer, *, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="autotp", docs_url=None, redoc_url=None)
    created = int(time.time())

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.status}},
            status_code=exc.status,
        )

    async def body_of(http: HttpRequest) -> dict:
        if api_key is not None and http.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")
        if engine.error is not None:
            raise ApiError(503, engine.error, "server_error")
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model", model_name) != model_name:
            raise ApiError(
                404, f"model {body.get('model')!r} is not served here; this server serves {model_name!r}", param="model"
            )
        return body

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def logprobs_of(items: list, chat: bool):
        if chat:
            return {
                "content": [
                    {
                        "token": token_text(t),
                        "logprob": lp,
                        "bytes": list(token_text(t).encode()),
                        "top_logprobs": [
                            {"token": token_text(i), "logprob": v, "bytes": list(token_text(i).encode())}
                            for i, v in top
                        ],
                    }
                    for t, lp, top in items
                ]
            }
        return {
            "tokens": [token_text(t) for t, _, _ in items],
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [{token_text(i): v for i, v in top} for _, _, top in items],
        }

    async def serve(http: HttpRequest, prompt: list, body: dict, chat: bool):
        try:
            sampling = sampling_of(body, max(1, engine.scheduler.max_model_len - len(prompt)))
        except Refused as exc:
            raise ApiError(400, str(exc)) from exc
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        request = Request(prompt, sampling, lambda r: loop.call_soon_threadsafe(queue.put_nowait, _snapshot(r)))
        try:
            engine.submit(request)
        except Refused as exc:
            raise ApiError(400, str(exc), param="prompt") from exc
        except RuntimeError as exc:
            raise ApiError(503, str(exc), "server_error") from exc
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        want_logprobs = sampling.logprobs is not None

        def usage(done: dict) -> dict:
            out = sum(c["tokens"] for c in done.values())
            return {"prompt_tokens": len(prompt), "completion_tokens": out, "total_tokens": len(prompt) + out}

        async def updates():
            """The request's snapshots until it finishes; aborted if the client leaves."""
            finished = False
            try:
                while not finished:
                    try:
                        update = await asyncio.wait_for(queue.get(), 0.5)
                    except TimeoutError:
                        if await http.is_disconnected():
                            return
                        continue
                    if update["error"] is not None:
                        raise ApiError(503, update["error"], "server_error")
                    finished = update["finished"]
                    yield update
            finally:
                if not finished:
                    engine.abort(request)

        if not body.get("stream"):
            texts, logs, done = {}, {}, {}
            async for update in updates():
                for c in update["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    logs.setdefault(c["index"], []).extend(c["logprobs"])
                    done[c["index"]] = c
            choices = [
                {
                    "index": i,
                    "finish_reason": done[i]["finish_reason"],
                    "logprobs": logprobs_of(logs[i], chat) if want_logprobs else None,
                    **({"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}),
                }
                for i in sorted(done)
            ]
            return JSONResponse({**head, "choices": choices, "usage": usage(done)})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        async def events():
            done: dict = {}
            if chat:
                first = [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(sampling.n)
                ]
                yield f"data: {json.dumps({**chunk_head, 'choices': first})}\n\n"
            try:
                async for update in updates():
                    for c in update["choices"]:
                        done[c["index"]] = c
                        if not c["text"] and not c["finish_reason"] and not c["logprobs"]:
                            continue
                        part = {
                            "index": c["index"],
                            "finish_reason": c["finish_reason"],
                            "logprobs": logprobs_of(c["logprobs"], chat) if want_logprobs else None,
                            **({"delta": {"content": c["text"]}} if chat else {"text": c["text"]}),
                        }
                        yield f"data: {json.dumps({**chunk_head, 'choices': [part]})}\n\n"
            except ApiError as exc:
                yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind, 'code': 503}})}\n\n"
                return
            if include_usage:
                yield f"data: {json.dumps({**chunk_head, 'choices': [], 'usage': usage(done)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def guarded(handler):
        async def run(http: HttpRequest):
            try:
                return await handler(http)
            except ApiError as exc:
                return error(exc)

        run.__name__ = handler.__name__
        return run

    @app.post("/v1/completions")
    @guarded
    async def completions(http: HttpRequest):
        body = await body_of(http)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise ApiError(400, "prompt must be one non-empty string or list of token ids", param="prompt")
        if any(t < 0 or t >= engine.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {engine.vocab_size})", param="prompt")
        return await serve(http, prompt, body, chat=False)

    @app.post("/v1/chat/completions")
    @guarded
    async def chat_completions(http: HttpRequest):
        body = await body_of(http)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"{model_name}'s tokenizer has no chat template: use /v1/completions")
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return await serve(http, list(prompt), body, chat=True)

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
        lines = []
        for name, value in engine.metrics().items():
            kind = "counter" if name in ("generation_tokens", "preemptions") else "gauge"
            metric = f"autotp_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
        for name, histogram in engine.histograms().items():  # latencies (serving/latency_metrics.py)
            lines += histogram.lines(f"autotp_{name}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
