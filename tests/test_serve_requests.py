"""``autotp serve`` at its door, as a user's client meets it: requests typed as OpenAI defines them, text that arrives
in whole characters, limits checked before any work, right figures on /metrics, nothing listening beyond --host.

One server for the module (starting one is the expensive part), over a byte-level BPE tokenizer built here (a
character outside its training text is several byte tokens) and a LLaMA whose greedy tokens are known: after a space
(a completion's prompt " ", or the chat template's last token) it writes the bytes of '€é😀 ' again and again, a
rival token 1 logit behind each (tests/helpers/serving.py)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.helpers.serving import VOCAB, Server, byte_tokenizer, post, read_metrics, save_cycle_model

pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "secret-key"
CYCLE = "€é😀 "  # what the model writes after a space, over and over: 3, 2, 4 and 1 byte tokens
RIVALS = "bcdfghjkmp"  # the token 1 logit behind each of the cycle's 10
LIMIT = 2**20  # --max-request-bytes
BLOCKS = 16  # --kv-blocks of 16 tokens: room for the 2 sequences that run at once (--max-num-seqs)
MARGIN = 1e-3  # greedy choices closer than this may differ by rounding


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cycle")
    words = byte_tokenizer(VOCAB)
    cycle = words(CYCLE[-1] + CYCLE[:-1])["input_ids"]
    model = save_cycle_model(directory, cycle, [words(c)["input_ids"][0] for c in RIVALS])
    assert len(cycle) == 10, "each character of the cycle was meant to be its bytes' tokens"
    with Server(
        directory,
        "--api-key",
        KEY,
        "--max-num-seqs",
        "2",
        "--kv-blocks",
        str(BLOCKS),
        "--host",
        "127.0.0.1",
        "--max-request-bytes",
        "1MiB",
    ) as server:
        yield server, model, words, directory.name


def _client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _refused(call, param: str) -> str:
    """The message of the 400 that ``call`` gets, which names ``param``."""
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and param in error["message"], error
    return error["message"]


def _greedy(model, prompt: list, tokens: int, presence: float = 0.0, frequency: float = 0.0) -> list:
    """transformers' greedy tokens with OpenAI's penalties: logits - presence * [count > 0] - frequency * count, the
    counts over the generated tokens; every choice's margin over the runner-up above MARGIN."""
    ids, counts = list(prompt), torch.zeros(VOCAB)
    for _ in range(tokens):
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[0, -1] - presence * (counts > 0) - frequency * counts
        first, second = scores.topk(2).values
        assert first - second > MARGIN, "a near tie: the test's model was meant to avoid one"
        ids.append(int(scores.argmax()))
        counts[ids[-1]] += 1
    return ids[len(prompt) :]


def test_requests_are_typed_as_openai_defines_them_and_penalties_are_its(served):
    """Fields OpenAI defines are accepted at the values that ask for nothing (what clients send by default) and
    refused, by name, at any other value autotp cannot serve; out-of-range or unknown fields are OpenAI's 400, not
    FastAPI's 422.  Presence and frequency penalties give the tokens transformers gives with them applied."""
    server, model, words, name = served
    client = _client(server)
    plain = client.completions.create(
        model=name,
        prompt=" ",
        max_tokens=10,
        temperature=0,
        presence_penalty=0,
        frequency_penalty=0,
        user="someone",
        logit_bias={},
        echo=False,
        best_of=1,
    )
    assert plain.choices[0].text == CYCLE
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        user="someone",
        store=False,
        response_format={"type": "text"},
        presence_penalty=0,
        metadata={"k": "v"},
        tools=[],
        parallel_tool_calls=True,
    )
    assert chat.choices[0].finish_reason == "length"

    ask = {"model": name, "prompt": "a", "max_tokens": 4}
    _refused(lambda: client.completions.create(**ask, echo=True), "echo")
    _refused(lambda: client.completions.create(**ask, logit_bias={"5": 10}), "logit_bias")
    _refused(lambda: client.completions.create(**ask, best_of=3), "best_of")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    _refused(
        lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], tools=[tool]),
        "tools",
    )
    assert "less than or equal to 2" in _refused(
        lambda: client.completions.create(**ask, temperature=2.5), "temperature"
    )
    _refused(lambda: client.completions.create(**ask, presence_penalty=-3), "presence_penalty")
    assert "unrecognized" in _refused(lambda: client.completions.create(**ask, extra_body={"min_q": 1}), "min_q")
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    _refused(
        lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": image}]), "messages"
    )
    status, body = post(server, "/v1/completions", b'["a"]', key=KEY)
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = post(server, "/v1/completions", b'{"prompt": " ", "n": "two"}', key=KEY)
    assert status == 400 and body["error"]["param"] == "n"

    prompt = words(" ")["input_ids"]
    for tokens, penalties in [(14, {"presence_penalty": 1.5}), (34, {"frequency_penalty": 0.4})]:
        reply = client.completions.create(
            model=name, prompt=" ", max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}, **penalties
        )
        expected = _greedy(
            model,
            prompt,
            tokens,
            presence=penalties.get("presence_penalty", 0.0),
            frequency=penalties.get("frequency_penalty", 0.0),
        )
        assert expected != _greedy(model, prompt, tokens), "the penalty was meant to change the tokens"
        assert reply.choices[0].text == words.decode(expected, skip_special_tokens=True), penalties


def test_text_arrives_in_whole_characters_streamed_or_not(served):
    """Each character of the cycle is 1 to 4 tokens: no piece of the reply, streamed or not, completion or chat,
    holds U+FFFD, and the pieces join to the characters; a stop string is found in the whole text."""
    server, _, _, name = served
    client = _client(server)
    whole = client.completions.create(model=name, prompt=" ", max_tokens=20, temperature=0)
    assert whole.choices[0].text == CYCLE * 2
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=name, prompt=" ", max_tokens=20, temperature=0, stream=True)
    ]
    assert "".join(pieces) == CYCLE * 2 and not any("\ufffd" in p for p in pieces), pieces
    assert {"€", "é", "😀"} <= set(pieces), "each character was meant to arrive in a chunk of its own"
    messages = [{"role": "user", "content": "hi"}]
    chunks = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert not any("\ufffd" in d for d in deltas), deltas
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
    assert "".join(deltas) == chat.choices[0].message.content and "\ufffd" not in chat.choices[0].message.content

    for stream in (False, True):
        answer = client.completions.create(
            model=name, prompt=" ", max_tokens=20, temperature=0, stop=["😀 €"], stream=stream
        )
        parts = list(answer) if stream else [answer]
        assert "".join(p.choices[0].text for p in parts) == "€é"
        assert parts[-1].choices[0].finish_reason == "stop"


def _chunked(server: Server, pieces: list[bytes], end: bool) -> int:
    """POST /v1/completions with a chunked body (no Content-Length): the response's status."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for header, value in [
        ("Authorization", f"Bearer {KEY}"),
        ("Content-Type", "application/json"),
        ("Transfer-Encoding", "chunked"),
    ]:
        connection.putheader(header, value)
    connection.endheaders()
    for piece in pieces:
        connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    if end:
        connection.send(b"0\r\n\r\n")
    status = connection.getresponse().status
    connection.close()
    return status


def test_limits_come_before_work(served):
    """JSON only (415), a body over --max-request-bytes refused whether it says its length or not (413), a lone
    surrogate refused as OpenAI's 400, and a long prompt tokenized off the event loop: /health answers meanwhile."""
    server, _, _, _ = served
    assert post(server, "/v1/completions", b'{"prompt": "a"}', key=KEY, content_type="text/plain")[0] == 415
    assert post(server, "/v1/completions", b'{"prompt": "a"}', key=KEY, content_type=None)[0] == 415
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        headers={
            "Authorization": f"Bearer {KEY}",
            "Content-Length": str(10 * LIMIT),
            "Content-Type": "application/json",
        },
    )
    answer = connection.getresponse()
    assert answer.status == 413 and "--max-request-bytes" in json.loads(answer.read())["error"]["message"]
    connection.close()
    assert _chunked(server, [b'{"prompt": "a", ', b'"max_tokens": 2}'], end=True) == 200
    assert _chunked(server, [b" " * (LIMIT // 16)] * 16 + [b" "], end=False) == 413

    for path, body in [
        ("/v1/completions", b'{"prompt": "a\\ud800"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff a"}]}'),
    ]:
        status, answer = post(server, path, body, key=KEY)
        assert status == 400 and "not valid Unicode" in answer["error"]["message"], answer
        assert answer["error"]["type"] == "invalid_request_error"

    done: dict = {}

    def long_prompt() -> None:  # 220,000 tokens: tokenized, then refused as longer than a sequence holds
        status, _ = post(server, "/v1/completions", json.dumps({"prompt": "the fox " * 110_000}).encode(), key=KEY)
        done["prompt"] = (time.monotonic(), status)

    thread = threading.Thread(target=long_prompt)
    thread.start()
    time.sleep(0.15)
    with urllib.request.urlopen(server.url + "/health", timeout=60) as answer:
        assert answer.status == 200
    health = time.monotonic()
    thread.join(60)
    assert done["prompt"][1] == 400 and health < done["prompt"][0], "/health waited for the tokenizer"


def test_metrics_are_right_under_load_and_nothing_listens_beyond_the_host(served):
    """4 streams of 100 tokens where 2 sequences run at once: /metrics, read while they run, counts 2 running and 2
    waiting, the blocks they hold and a rate above 0; after, every token counted.  Every socket the server's
    processes listen on (HTTP, the ranks' store and gloo) is on 127.0.0.1, the --host given."""
    import psutil

    server, _, _, name = served
    lead = psutil.Process(server.process.pid)
    listening = {
        (c.laddr.ip, c.laddr.port)
        for p in [lead, *lead.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert ("127.0.0.1", server.port) in listening and len(listening) > 1, listening
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening

    client = _client(server)
    before, started = read_metrics(server), time.monotonic()
    first = threading.Event()
    replies: list = []

    def stream() -> None:
        for chunk in client.completions.create(
            model=name,
            prompt=" ",
            max_tokens=100,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            first.set()
            if chunk.usage:
                replies.append(chunk.usage.completion_tokens)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert first.wait(60)
    during, deadline = read_metrics(server), time.monotonic() + 30
    # until the 4 requests have arrived and a step has scheduled the first 2 (the figures are published after each
    # change, so one read may fall between a request's arrival and the step that runs it), before the first 2 finish
    while (during["autotp_requests_running"], during["autotp_requests_waiting"]) != (2, 2) and not replies:
        if time.monotonic() > deadline:
            break
        during = read_metrics(server)
    for thread in threads:
        thread.join(120)
    after = read_metrics(server)
    took = time.monotonic() - started

    assert during["autotp_requests_running"] == 2 and during["autotp_requests_waiting"] == 2, during
    assert 2 <= during["autotp_kv_blocks_used"] <= 2 * 7 and during["autotp_kv_blocks_total"] == BLOCKS, during
    assert during["autotp_tokens_per_second"] > 0, during
    assert replies == [100] * 4
    generated = after["autotp_generation_tokens_total"] - before["autotp_generation_tokens_total"]
    assert generated == 400 and after["autotp_preemptions_total"] == before["autotp_preemptions_total"]
    assert after["autotp_requests_running"] == after["autotp_requests_waiting"] == after["autotp_kv_blocks_used"] == 0
    window = after["autotp_tokens_per_second"] * 10  # tokens over the last 10 s
    assert window <= after["autotp_generation_tokens_total"]
    if took < 9:
        assert window >= generated, after
