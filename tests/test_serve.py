"""``autotp serve`` as a user runs it: a saved model directory, the server started by the command, requests sent by the
``openai`` client package.  Each request's tokens and log-probabilities are checked against transformers run on that
prompt alone, whatever ran beside it (continuous batching over a paged KV cache small enough to force preemption)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers.exact import TOL, sums_per_block
from tests.helpers.serving import Server, post, read_metrics, save_model, tokenizer

pytest.importorskip("openai")
pytest.importorskip("fastapi")

MARGIN = 1e-3  # greedy choices closer than this may differ by rounding
KEY = "secret-key"
LOAD_SECONDS = 120  # the load test's bound on a 2-core VM (measured: docs/serving.md)


def _client(server: Server, key: str = KEY):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _check_against_transformers(model, prompt: list, tokens: list, logprobs: list, top: list) -> None:
    """Teacher-forced: transformers' log-probabilities over prompt + tokens equal the server's at every step, and
    each greedy token is transformers' argmax wherever its top-2 margin exceeds MARGIN."""
    with torch.no_grad():
        ref = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert len(tokens) == len(logprobs) == len(top) == ref.shape[0]
    for step, (token, logprob, best) in enumerate(zip(tokens, logprobs, top, strict=True)):
        torch.testing.assert_close(torch.tensor(logprob), ref[step, token], **TOL)
        ids = torch.tensor([i for i, _ in best])
        torch.testing.assert_close(torch.tensor([v for _, v in best]), ref[step, ids], **TOL)
        first, second = ref[step].topk(2).values
        if first - second > MARGIN:
            assert token == int(ref[step].argmax()), f"step {step}: greedy token {token}, transformers' argmax differs"
    generated = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=len(tokens),
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt) :].tolist()
    for step, (mine, theirs) in enumerate(zip(tokens, generated, strict=False)):
        first, second = ref[step].topk(2).values
        if first - second <= MARGIN:
            break
        assert mine == theirs, f"step {step}: {mine} != transformers' generate's {theirs}"


# (ranks, family): LLaMA's 2 KV heads on 4 ranks are fewer than the ranks; Mixtral's experts are planned as autotp
# plans them (split, dealt or sent by all-to-all)
SERVED = [
    (2, "llama"),
    pytest.param(4, "llama", marks=pytest.mark.slow),
    pytest.param(2, "mixtral", marks=pytest.mark.slow),
    pytest.param(4, "mixtral", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world", "family"), SERVED)
def test_requests_arriving_at_different_times_get_transformers_answers(tmp_path, world, family):
    """8 requests (completions and chat, streamed and not) of 3 to 14 prompt tokens, started 0.05 s apart; the cache
    holds 8 blocks of 4 tokens and a step 8 tokens, so prompts are chunked and sequences preempted."""
    model = save_model(tmp_path, family, seed=3)
    words = tokenizer(model.config.vocab_size)
    server = Server(
        tmp_path,
        "--kv-blocks",
        "8",
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        "8",
        "--max-num-seqs",
        "8",
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
        world=world,
    )
    with server:
        client = _client(server)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        results: dict = {}

        def ask(i: int) -> None:
            time.sleep(0.05 * i)
            text = " ".join(f"w{10 + (7 * i + 3 * k) % 80}" for k in range(3 + (i * 5) % 12))
            if i % 3 == 2:  # chat: the tokenizer's template around the message
                messages = [{"role": "user", "content": text}]
                prompt = words.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
                )
                content = reply.choices[0].logprobs.content
                results[i] = (
                    list(prompt),
                    [words.convert_tokens_to_ids(c.token) for c in content],
                    [c.logprob for c in content],
                    [[(words.convert_tokens_to_ids(t.token), t.logprob) for t in c.top_logprobs] for c in content],
                    reply.usage,
                )
                return
            prompt = words(text)["input_ids"]
            if i % 3 == 1:  # streamed
                chunks = list(
                    client.completions.create(
                        model="tiny",
                        prompt=text,
                        max_tokens=12,
                        temperature=0,
                        logprobs=3,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                parts = [c.choices[0].logprobs for c in chunks if c.choices]
                usage = chunks[-1].usage
            else:
                reply = client.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, logprobs=3)
                parts, usage = [reply.choices[0].logprobs], reply.usage
            tokens = [words.convert_tokens_to_ids(t) for p in parts for t in p.tokens]
            results[i] = (
                prompt,
                tokens,
                [v for p in parts for v in p.token_logprobs],
                [[(words.convert_tokens_to_ids(t), v) for t, v in d.items()] for p in parts for d in p.top_logprobs],
                usage,
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert sorted(results) == list(range(8)), "a request got no answer"
        metrics = read_metrics(server)
        assert metrics["autotp_preemptions_total"] > 0, "the small cache was meant to force preemption"
        assert metrics["autotp_kv_blocks_used"] == 0 and metrics["autotp_requests_running"] == 0
        for prompt, tokens, logprobs, top, usage in results.values():
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(tokens)
            _check_against_transformers(model, prompt, tokens, logprobs, top)

        # bad input: one line each, a 4xx
        status, body = post(server, "/v1/completions", b'{"prompt": "w9", ', key=KEY)
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = post(server, "/v1/completions", json.dumps({"model": "other", "prompt": "w9"}).encode(), key=KEY)
        assert status == 404 and "'tiny'" in body["error"]["message"]
        status, body = post(server, "/v1/completions", json.dumps({"prompt": " ".join(["w9"] * 30)}).encode(), key=KEY)
        assert status == 400 and "at most 32" in body["error"]["message"]
        status, body = post(server, "/v1/completions", json.dumps({"prompt": "w9"}).encode(), key="wrong")
        assert status == 401

        # sampling: a seed reproduces, n choices, a stop string ends the text before it
        seeded = {
            "model": "tiny",
            "prompt": "w9 w10",
            "max_tokens": 6,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 7,
            "n": 2,
        }
        a, b = client.completions.create(**seeded), client.completions.create(**seeded)
        assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
        greedy = client.completions.create(model="tiny", prompt="w9 w10", max_tokens=6, temperature=0).choices[0]
        stop = greedy.text.split()[2]
        cut = client.completions.create(model="tiny", prompt="w9 w10", max_tokens=6, temperature=0, stop=[stop])
        assert cut.choices[0].text == greedy.text[: greedy.text.index(stop)] and cut.choices[0].finish_reason == "stop"

        # a client that leaves frees its blocks; SIGTERM drains the request in flight, then the server exits 0
        stream = client.completions.create(model="tiny", prompt="w9 w10", max_tokens=12, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
        time.sleep(2)
        assert read_metrics(server)["autotp_kv_blocks_used"] == 0
        chunks: list = []
        started = threading.Event()

        def in_flight() -> None:
            for chunk in client.completions.create(
                model="tiny", prompt="w9 w10", max_tokens=12, temperature=0, stream=True
            ):
                chunks.append(chunk)
                started.set()

        flight = threading.Thread(target=in_flight)
        flight.start()
        assert started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        flight.join(60)
        assert server.process.wait(60) == 0, server.output()
        assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_under_torchrun_each_process_is_a_rank_and_sigterm_drains(tmp_path):
    """``torchrun --nproc-per-node 2 autotp serve DIR``: rank 0 serves; torchrun passes its SIGTERM to every rank, the
    others wait for rank 0's last step, and no rank fails (torchrun itself exits 1 when signalled, as it always
    does)."""
    save_model(tmp_path)
    with Server(tmp_path, torchrun=True) as server:
        reply = _client(server).chat.completions.create(
            model=tmp_path.name,
            temperature=0,
            messages=[{"role": "user", "content": "w9 w10"}],
            extra_body={"ignore_eos": True},
        )
        # no max_tokens: a chat reply runs to the end of the sequence's room (128 positions)
        assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens == 7
        assert reply.usage.completion_tokens == 128 - 7
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        said = server.output()
        assert "closing signal SIGTERM" in said and "ChildFailedError" not in said and "ranks failed" not in said, said


def _served_model(family: str):
    """The engine tests' model, the same on every rank: LLaMA; Gemma-3 (sliding-window and full layers alternating,
    a window of 4); Mistral with every layer windowed to 4."""
    import transformers

    from tests.helpers import configs

    torch.manual_seed(5)
    if family == "gemma3":
        return transformers.Gemma3ForCausalLM(configs.by_layer_type("Gemma3TextConfig")).eval()
    if family == "mistral":
        config = configs.architecture("mistral", sliding_window=4)
        config.use_cache = True
        return transformers.MistralForCausalLM(config).eval()
    return transformers.LlamaForCausalLM(configs.llama(use_cache=True, max_position_embeddings=128)).eval()


def _engine_logits(rank: int, world: int, family: str) -> list:
    """8 requests submitted to the engine two steps apart over a pool of 8 blocks of 4 tokens, every step's full
    logits recorded (rank 0's: they pick the tokens)."""
    import autotp
    from autotp.serving import engine as serving
    from autotp.serving.choices import Request, Sampling

    model = _served_model(family)
    sharded = autotp.parallelize(model, (torch.zeros(2, 8, dtype=torch.long),))
    engine = serving.Engine(
        sharded,
        tokenizer(model.config.vocab_size),
        blocks=8,
        block_size=4,
        max_num_seqs=8,
        max_batched_tokens=8,
        max_model_len=32,
    )
    if rank != 0:
        engine.follow()
        return []
    seen: dict = {}
    choose = serving.Engine._choose

    def recording(self, logits, rows):
        for run, row in zip(rows, logits, strict=True):
            if run is not None and run.samples:
                seen.setdefault(id(run.sequence.owner[0]), []).append(row.clone())
        return choose(self, logits, rows)

    serving.Engine._choose = recording
    loop = threading.Thread(target=engine.run)
    loop.start()
    requests = []
    for i in range(8):
        while engine.generated < 2 * i and i:
            time.sleep(0.001)
        prompt = [10 + (7 * i + 3 * k) % 80 for k in range(3 + (i * 5) % 12)]
        requests.append(Request(prompt, Sampling(max_tokens=12, temperature=0, ignore_eos=True), lambda r: None))
        engine.submit(requests[-1])
    while not all(r.finished for r in requests):
        time.sleep(0.01)
    engine.stop()
    loop.join()
    assert engine.scheduler.preemptions > 0, "the small pool was meant to force preemption"
    assert engine.program.autotp_programs.made == 0, "the step program was captured again for some step's sizes"
    plan = engine.program.autotp_plan
    pools = [n for n in engine.program.graph.nodes if n.op == "get_attr" and n.target.startswith(("keys_", "values_"))]
    layout = {
        "pools": {n: p for n, p in plan.params.items() if n.startswith(("keys_", "values_"))},
        "local": tuple(engine.program.get_buffer("keys_0").shape),
        "sums": dict(sums_per_block(plan)),
        "in_blocks": sorted({c["op"] for c in plan.collectives if ".layers." in c["module"]}),
        "pool_reads": sorted(
            {str(user.target) for node in pools + [u for p in pools for u in p.users] for user in node.users}
        ),
    }
    return [
        (r.prompt, r.choices[0].sequence.output, torch.stack(seen[id(r.choices[0])]).tolist(), layout) for r in requests
    ]


@pytest.mark.parametrize(
    "family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow)]
)
def test_every_steps_logits_equal_transformers_whatever_runs_beside(family):
    """The engine itself on 2 ranks: 8 requests joining a running batch two steps apart, prompts chunked, sequences
    preempted; each step's whole row of logits equals transformers' for that prompt alone (teacher-forced), with
    full attention and with sliding windows shorter than the prompts."""
    from tests.helpers.distributed import run_ranks

    results = run_ranks(2, _engine_logits, family)[0]
    model = _served_model(family)
    if family == "llama":  # the pool split by KV heads (2 on 2 ranks), Megatron's two sums a block, nothing else
        layout = results[0][3]
        assert set(layout["pools"].values()) == {"S(1)"} and len(layout["pools"]) == 4
        assert layout["local"] == ((8 + 1) * 4, 1, 16)  # 8 blocks and the scratch block, of 4 slots; 1 KV head
        assert layout["sums"] == {0: 2, 1: 2} and layout["in_blocks"] == ["all_reduce"]
        # what reads the pool (and its in-place writes): the writes and the paged attention, no copy of a context
        assert layout["pool_reads"] == ["aten.index_copy_.default", "autotp.paged_attention.default"], layout
    for prompt, output, logits, _ in results:
        with torch.no_grad():
            ref = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        assert ref.shape == (12, model.config.vocab_size)
        torch.testing.assert_close(torch.tensor(logits), ref, **TOL)


def _ranks_of(launcher: int) -> list[int]:
    """The rank processes ``autotp serve`` started, in rank order (multiprocessing's spawned children)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    spawned = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    return sorted(spawned)


def test_a_dead_rank_makes_the_server_answer_503_and_exit_non_zero(tmp_path):
    save_model(tmp_path)
    with Server(tmp_path) as server:
        client = _client(server)
        assert client.completions.create(model=tmp_path.name, prompt="w9 w10", max_tokens=2).usage.completion_tokens
        os.kill(_ranks_of(server.process.pid)[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and status != 503:
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as answer:
                    status = answer.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            time.sleep(0.1)
        assert status == 503, "the server never said it had failed"
        status, body = post(server, "/v1/completions", json.dumps({"prompt": "w9"}).encode(), key=KEY)
        assert status == 503 and "ranks failed" in body["error"]["message"]
        assert server.process.wait(90) != 0


@pytest.mark.slow
def test_two_hundred_requests_from_32_clients_are_all_answered(tmp_path):
    """A load test on localhost: 200 completions of max_tokens 16 from 32 concurrent clients, 2 ranks, within
    LOAD_SECONDS (docs/serving.md gives the measured time)."""
    from concurrent.futures import ThreadPoolExecutor

    save_model(tmp_path)
    with Server(tmp_path, "--max-num-seqs", "32") as server:
        client = _client(server)
        start = time.monotonic()

        def one(i: int):
            prompt = " ".join(f"w{10 + (i * 7 + k) % 80}" for k in range(4 + i % 20))
            return client.completions.create(
                model=tmp_path.name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(one, range(200)))
        took = time.monotonic() - start
    print(f"200 requests of 16 tokens from 32 clients: {took:.1f} s")
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16 for r in replies)
    assert took < LOAD_SECONDS, f"200 requests took {took:.0f} s"


def test_the_pool_is_sized_from_blocks_bytes_or_the_default():
    """--kv-blocks as given; --kv-cache-memory over a rank's bytes a block (its share of the KV heads, rounded up);
    on the CPU by default room for --max-num-seqs sequences of the longest length; too few bytes refused."""
    from types import SimpleNamespace

    from autotp.tools.serve import ServeOptions, bytes_of, kv_blocks
    from tests.helpers import configs

    config = configs.llama(num_key_value_heads=2)  # 2 blocks, 2 KV heads of 16
    sharded = SimpleNamespace(
        autotp_source=SimpleNamespace(config=config),
        autotp_device=torch.device("cpu"),
        parameters=lambda: iter([torch.nn.Parameter(torch.zeros(1))]),
    )
    assert bytes_of("4GiB") == 4 * 2**30 and bytes_of("512MB") == 512 * 10**6 and bytes_of("1000") == 1000
    per_block = 2 * 2 * 16 * 1 * 16 * 4  # keys and values, 2 layers, 16 tokens, 1 head of 2 on each of 4 ranks, fp32
    options = ServeOptions(model="m", world_size=4)
    assert kv_blocks(ServeOptions(model="m", world_size=4, kv_blocks=7), sharded, 64) == 7
    assert kv_blocks(ServeOptions(model="m", world_size=4, kv_cache_memory=10 * per_block + 1), sharded, 64) == 10
    assert kv_blocks(options, sharded, 64) == 32 * 4
    with pytest.raises(ValueError, match="holds no block"):
        kv_blocks(ServeOptions(model="m", world_size=4, kv_cache_memory=per_block - 1), sharded, 64)


def test_a_wrong_command_line_or_a_model_it_cannot_serve_is_one_line(tmp_path):
    """Refused before any rank starts, in one line with exit status 2: usage errors, an encoder (BERT) and a
    directory without weights through the command (its processes run at once); an encoder-decoder (T5) and a
    directory without a tokenizer by the same check in this process."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from autotp.serving.servable import check_servable
    from tests.helpers import configs

    autotp = Path(sys.executable).parent / "autotp"
    made = {name: tmp_path / name for name in ("bert", "t5", "weightless", "untokenized")}
    configs.architecture("bert").save_pretrained(made["bert"])
    configs.t5().save_pretrained(made["t5"])
    llama = configs.llama(use_cache=True)
    llama.save_pretrained(made["weightless"])
    tokenizer(llama.vocab_size).save_pretrained(made["weightless"])
    AutoModelForCausalLM.from_config(llama).save_pretrained(made["untokenized"])
    cases = [
        ([str(tmp_path / "nowhere")], "has no config.json"),
        ([str(tmp_path), "--kv-cache-memory", "4XB"], "not a size: '4XB'"),
        ([str(tmp_path), "--device", "gpu0"], "device must name a device as torch does"),
        ([str(made["bert"])], "holds an encoder (BertConfig"),
        ([str(made["weightless"])], "no model.safetensors"),
    ]
    runs = [
        subprocess.Popen(
            [str(autotp), "serve", *args, "--world-size", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _ in cases
    ]
    with pytest.raises(ValueError, match=r"holds an encoder-decoder model \(T5Config\)"):
        check_servable(made["t5"])
    with pytest.raises(ValueError, match="has no tokenizer that loads"):
        check_servable(made["untokenized"])
    for run, (_, says) in zip(runs, cases, strict=True):
        out, err = run.communicate(timeout=120)
        assert run.returncode == 2 and says in err and len(err.strip().splitlines()) == 1 and not out, err
