"""``autotp serve MODEL_DIR --world-size N``: the model sharded over N ranks behind an OpenAI-compatible endpoint.

The directory is checked first (serving/servable.py: a decoder-only causal LM, a tokenizer, every weight), so what
cannot be served is refused in one line before any rank starts.  Under torchrun each process is one rank; otherwise
this process starts the N ranks itself (one per GPU under NCCL, gloo processes on the CPU) and exits with rank 0's
status.  The ranks it starts meet through a file (no store listening on a port) and their gloo and NCCL sockets are
bound to the interface that holds --host, so nothing listens beyond the host given (under torchrun, its launcher
decides those).  Every rank loads only its pieces of the checkpoint and builds the step program; rank 0 then serves
HTTP (uvicorn) while its engine thread drives every rank's steps.  When rank 0 stops (SIGTERM: it drains the
requests in flight first) or fails, the whole group ends; a failed rank makes rank 0 answer 503 and exit non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GROUP_TIMEOUT = datetime.timedelta(seconds=60)  # a stopped rank is noticed within this (the idle tick is 1 s)
FAIL_GRACE_SECONDS = 2.0
MAX_REQUEST_BYTES = 4 * 2**20  # the default --max-request-bytes


@dataclass(frozen=True)
class ServeOptions:
    model: str
    world_size: int
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes a rank
    gpu_memory_utilization: float = 0.9  # the share of a GPU the server may use (the pool: what a step leaves)
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str | None = None
    device: str | None = None
    enforce_eager: bool = False  # no decode graphs, even on a GPU
    compile: bool = False  # decode graphs compiled by torch.compile (inductor)
    max_request_bytes: int = MAX_REQUEST_BYTES

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name


def bytes_of(text: str) -> int:
    """'4GiB', '512MB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 4GiB, 512MB or a number of bytes)")
    number, unit, binary = match.groups()
    return int(float(number) * (1024 if binary else 1000) ** " kmgt".index(unit or " "))


def device_name(text: str) -> str:
    """--device as torch names a device ('cuda', 'cuda:1', 'cpu'): a usage error otherwise."""
    from autotp.options import parse_device

    try:
        parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def fraction(text: str) -> float:
    """--gpu-memory-utilization: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"not a fraction in (0, 1]: {text!r}")
    return value


def add_serve_parser(sub, positive) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a Hugging Face causal LM directory over an OpenAI-compatible HTTP "
        "API, sharded over --world-size ranks",
    )
    serve.add_argument("model", help="a directory with config.json, safetensors weights and a tokenizer")
    serve.add_argument(
        "--world-size",
        type=positive,
        default=None,
        help="tensor-parallel ranks (default: torchrun's WORLD_SIZE, else 1)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=positive, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: the directory's name)"
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("AUTOTP_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $AUTOTP_API_KEY, else none)",
    )
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--kv-blocks", type=positive, default=None, help="KV cache blocks (each --block-size tokens)")
    size.add_argument(
        "--kv-cache-memory",
        type=bytes_of,
        default=None,
        help="KV cache bytes a rank, e.g. 4GiB (default: on a GPU what --gpu-memory-utilization leaves; on "
        "the CPU room for --max-num-seqs sequences of --max-model-len)",
    )
    size.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=0.9,
        help="the share of each GPU's memory to use (default 0.9): the KV cache gets what is left of it after the "
        "weights, a profiling step at --max-num-batched-tokens and the decode graphs",
    )
    serve.add_argument("--block-size", type=positive, default=16, help="tokens a KV block")
    serve.add_argument("--max-num-seqs", type=positive, default=32, help="sequences running at once")
    serve.add_argument(
        "--max-num-batched-tokens",
        type=positive,
        default=512,
        help="tokens a step: running decodes first, prompt chunks fill the rest",
    )
    serve.add_argument(
        "--max-model-len",
        type=positive,
        default=None,
        help="tokens a sequence may hold (default: the config's max_position_embeddings)",
    )
    serve.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights' dtype (default: the checkpoint's)",
    )
    serve.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="where each rank's shards and KV cache live, e.g. cpu (default: this rank's GPU under NCCL, else the CPU)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=bytes_of,
        default=MAX_REQUEST_BYTES,
        help="the largest request body accepted, e.g. 1MiB (default 4MiB; larger: 413)",
    )
    graphs = serve.add_mutually_exclusive_group()
    graphs.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step op by op (default on a GPU: each batch bucket's step captured "
        "once as a CUDA graph and replayed)",
    )
    graphs.add_argument(
        "--compile",
        action="store_true",
        help="compile each batch bucket's decode step with torch.compile (inductor), on the CPU too",
    )


def serve_command(args) -> int:
    given = {k: v for k, v in vars(args).items() if k in ServeOptions.__dataclass_fields__}
    options = ServeOptions(**{**given, "world_size": args.world_size or int(os.environ.get("WORLD_SIZE", 1))})
    from autotp.serving.servable import check_servable

    check_servable(options.model)
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        return serve_rank(options)
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="autotp-serve-") as meeting:
        rendezvous = f"file://{Path(meeting) / 'store'}"
        ranks = [
            context.Process(target=_spawned, args=(rank, rendezvous, options), daemon=False)
            for rank in range(options.world_size)
        ]
        for process in ranks:
            process.start()
        for stop in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains its requests, then the group ends
            signal.signal(stop, lambda *_: ranks[0].terminate())
        return _supervise(ranks)


def _supervise(ranks: list) -> int:
    """Rank 0's exit status once it ends; a rank that died first gives rank 0 the group's timeout to notice, answer
    503 and exit, then every rank left is stopped."""
    lead, deadline = ranks[0], None
    while lead.is_alive():
        lead.join(0.5)
        if deadline is None and any(p.exitcode not in (None, 0) for p in ranks[1:]):
            deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds() + 30
        if deadline is not None and time.monotonic() > deadline:
            lead.terminate()
    for process in ranks[1:]:
        process.join(10)
        if process.is_alive():
            process.terminate()
    codes = [p.exitcode for p in ranks]
    return 0 if all(c == 0 for c in codes) else (codes[0] or 1)


def interface_of(host: str) -> str | None:
    """The network interface that holds ``host``'s address (None for every interface: 0.0.0.0, ::, or an address
    no interface holds, which uvicorn then refuses to bind)."""
    import psutil  # accelerate's dependency, so from_pretrained's

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    if any(ipaddress.ip_address(a.split("%")[0]).is_unspecified for a in addresses):
        return None
    return next(
        (
            name
            for name, held in psutil.net_if_addrs().items()
            if any(a.address.split("%")[0] in addresses for a in held)
        ),
        None,
    )


def _spawned(rank: int, rendezvous: str, options: ServeOptions) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(options.world_size),
        LOCAL_WORLD_SIZE=str(options.world_size),
    )
    interface = interface_of(options.host)
    if interface is not None:  # gloo's and NCCL's sockets listen on this interface only (a user's setting stays)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    code = serve_rank(options, rendezvous)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads may abort an interpreter's teardown


def serve_rank(options: ServeOptions, rendezvous: str | None = None) -> int:
    """One rank: joins the group (through ``rendezvous``, a file:// URL, or torchrun's environment), loads its pieces
    and runs; rank 0 serves HTTP."""
    import torch
    import torch.distributed as dist

    import autotp
    from autotp.serving.engine import Engine

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        where = (
            {}
            if rendezvous is None
            else {"init_method": rendezvous, "rank": int(os.environ["RANK"]), "world_size": options.world_size}
        )
        dist.init_process_group("nccl" if cuda else "gloo", timeout=GROUP_TIMEOUT, **where)
    if dist.get_world_size() != options.world_size:
        raise ValueError(f"--world-size {options.world_size}, but the launcher started {dist.get_world_size()} ranks")
    rank = dist.get_rank()
    dtype = getattr(torch, options.dtype) if options.dtype else None
    sharded = autotp.from_pretrained(options.model, dtype=dtype, device=options.device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.model)
    config = sharded.autotp_source.config.get_text_config()
    max_len = options.max_model_len or getattr(config, "max_position_embeddings", None) or 4096
    blocks = kv_blocks(options, sharded, max_len)
    engine = Engine(
        sharded,
        tokenizer,
        blocks=blocks or -(-max_len // options.block_size),  # a profiling pool: one sequence
        block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max_len,
        compile=decode_graphs(options, sharded.autotp_device),
    )
    if blocks is None:  # on a GPU: what the weights, a profiling step and the graphs leave (serving/pool_sizing.py)
        from autotp.serving.pool_sizing import profiled_blocks

        blocks = profiled_blocks(engine, options.gpu_memory_utilization, _block_bytes(options, sharded))
        engine.resize_pool(blocks)
    if rank != 0:  # stopped by rank 0's last step, after it drains: a launcher's SIGTERM to every rank waits for it
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, signal.SIG_IGN)
        engine.follow()
        return 0
    return _serve_http(engine, tokenizer, options, blocks)


def decode_graphs(options: ServeOptions, device):
    """vLLM's defaults: on a GPU the decode steps replayed as CUDA graphs unless --enforce-eager; --compile compiles
    them (inductor) as well, and on the CPU it is what turns graphs on."""
    from autotp.serving.decode_graphs import CompileOptions

    if options.enforce_eager or (device.type != "cuda" and not options.compile):
        return None
    return CompileOptions(backend="inductor" if options.compile else None)


def kv_blocks(options: ServeOptions, sharded, max_len: int) -> int | None:
    """Blocks of the pool: as asked, from the bytes asked, on the CPU room for --max-num-seqs sequences of
    max_len; None on a GPU, where a profiling step tells (serving/pool_sizing.py)."""
    from autotp.serving.pool_sizing import blocks_in

    if options.kv_blocks:
        return options.kv_blocks
    if options.kv_cache_memory is not None:
        return blocks_in(options.kv_cache_memory, _block_bytes(options, sharded))
    if sharded.autotp_device.type == "cuda":
        return None
    return options.max_num_seqs * -(-max_len // options.block_size)


def _block_bytes(options: ServeOptions, sharded) -> int:
    from autotp.serving.generation import dtype_of
    from autotp.serving.pool_sizing import block_bytes

    config = sharded.autotp_source.config.get_text_config()
    return block_bytes(config, options.block_size, options.world_size, dtype_of(sharded).itemsize)


def _serve_http(engine, tokenizer, options: ServeOptions, blocks: int) -> int:
    import uvicorn

    from autotp.serving.openai_api import make_app

    failed = threading.Event()

    def drive():
        try:
            engine.run()
        except Exception:
            failed.set()
            time.sleep(FAIL_GRACE_SECONDS)  # clients hear 503 a while before the port closes
            server.should_exit = True

    app = make_app(
        engine, tokenizer, model_name=options.name, api_key=options.api_key, max_request_bytes=options.max_request_bytes
    )
    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    loop = threading.Thread(target=drive, name="autotp-engine", daemon=True)
    loop.start()
    print(
        f"autotp: serving {options.name} on http://{options.host}:{options.port}/v1 over {options.world_size} "
        f"rank(s), {blocks} KV blocks of {options.block_size} tokens",
        flush=True,
    )
    for stop in (signal.SIGTERM, signal.SIGINT):  # uvicorn raises what it caught again once drained: heard here
        signal.signal(stop, lambda *_: None)
    server.run()  # until SIGINT/SIGTERM (after the requests in flight) or a failure
    engine.stop()
    loop.join(None if not failed.is_set() else 5)
    if failed.is_set():
        print(f"autotp serve: {engine.error}", file=sys.stderr, flush=True)
        return 1
    return 0
