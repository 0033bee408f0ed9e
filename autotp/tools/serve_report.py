"""`autotp plan MODEL --serve`: the figures a deployment is sized by (serving/serve_plan.py), in a few lines."""

from __future__ import annotations

import argparse

from autotp.tools.cli_errors import UsageError, positive


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--serve",
        action="store_true",
        help="plan for serving: a decode step with its KV cache at --context, and the prefill, with one set of weights",
    )
    parser.add_argument(
        "--context", type=positive, default=8192, help="tokens a sequence may hold (vLLM's --max-model-len)"
    )
    parser.add_argument("--max-batch", type=positive, default=64, help="sequences decoded together (--max-num-seqs)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive,
        default=512,
        help="tokens of one prefill chunk, as the server's --max-num-batched-tokens (default 512)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of a device's memory for weights and cache (--gpu-memory-utilization)",
    )
    parser.add_argument(
        "--max-decode-ms",
        type=float,
        default=None,
        help="also name the smallest TP size (1, 2, 4, 8) whose decode step meets this",
    )


def print_serving(args, load_model) -> int:
    """Print the serving plan of ``args.model``; with --max-decode-ms, the TP size that meets it (exit status 1 if
    none of 1, 2, 4, 8 does)."""
    from autotp.serving.serve_plan import fastest_tp_within, plan_serving

    if not 0 < args.memory_fraction <= 1:
        raise UsageError(
            f"--memory-fraction must be in (0, 1], got {args.memory_fraction}",
            "give a share of device memory, e.g. --memory-fraction 0.9",
        )
    if args.max_decode_ms is not None and not args.max_decode_ms > 0:
        raise UsageError(f"--max-decode-ms must be positive, got {args.max_decode_ms}", "give milliseconds, e.g. 20")
    serving = {
        "context": args.context,
        "max_batch": args.max_batch,
        "topology": args.topology,
        "memory_fraction": args.memory_fraction,
        "prefill_tokens": args.max_num_batched_tokens,
    }
    served = plan_serving(load_model()[0], world_size=args.world_size, **serving)
    if served.batch < served.requested:
        print(
            f"--max-batch {served.requested} does not fit at TP {served.world_size}: {served.batch} sequences of "
            f"{served.context} tokens do, planned below; serve with --max-num-seqs {served.batch}, or a larger "
            "--world-size or a shorter --context for more"
        )
    print(_line(served))
    if args.max_decode_ms is None:
        return 0
    size, tried = fastest_tp_within(lambda: load_model()[0], decode_ms=args.max_decode_ms, **serving)
    steps = ", ".join(
        f"TP {k} {v.decode_seconds * 1e3:.2f} ms" if v else f"TP {k}: not one sequence fits" for k, v in tried.items()
    )
    if size is None:
        print(
            f"no TP size of 1, 2, 4, 8 decodes a step within {args.max_decode_ms} ms ({steps}): use a smaller "
            "--max-batch or --context, or faster devices"
        )
        return 1
    print(f"TP {size} is the smallest size that decodes a step within {args.max_decode_ms} ms ({steps})")
    return 0


def _line(s) -> str:
    return (
        f"TP {s.world_size}, context {s.context}, batch {s.batch}: prefill {s.prefill_seconds_per_1000 * 1e3:.2f} "
        f"ms per 1,000 tokens (in chunks of {s.prefill_tokens}); decode {s.decode_seconds * 1e3:.2f} ms a step "
        f"(reading the weights and cache at memory bandwidth: {s.bandwidth_bound_seconds * 1e3:.2f} ms), "
        f"{s.tokens_per_second:,.0f} tokens/s; "
        f"KV cache {s.kv_bytes_per_sequence / 2**20:.1f} MiB a sequence per device: "
        f"{s.sequences_that_fit} sequences of {s.context} tokens fit beside the weights in "
        f"{s.memory_fraction:.0%} of a device (estimates)"
    )
