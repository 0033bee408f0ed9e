"""Dropout that trains, on 2 gloo ranks: how close reference mode is to one process, the drop rates of the default
mode, and what each costs in a training step (GPT-2, dropout 0.1 everywhere, batch 4 x 64 tokens).

    python benchmarks/dropout.py [--layers 2] [--hidden 128] [--repeats 5]

For eager attention (a dropout op on the scores) and SDPA (its dropout_p): reference mode's largest output and
gradient differences from one process with the same seed; the default mode's drop rate over every dropout op of
one step; and the median training step (forward + backward) of the program captured in eval mode (no dropout),
the default mode and reference mode.  Fails if reference mode is not exact or the drop rate is far from 0.1.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
import warnings

import torch
from machine import describe


def _model(attention: str, layers: int, hidden: int, training: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        use_cache=False,
        attn_pdrop=0.1,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_implementation=attention,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train(training)


def _step(program, x) -> float:
    start = time.perf_counter()
    program(x).logits.float().logsumexp(-1).mean().backward()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _rank(rank: int, world: int, layers: int, hidden: int, repeats: int) -> dict:
    import autotp
    from autotp.runtime.dropout import Dropout, random_ops

    warnings.simplefilter("ignore")
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    found = {}
    for attention in ("eager", "sdpa"):
        model = _model(attention, layers, hidden, True)
        programs = {
            "eval": autotp.parallelize(_model(attention, layers, hidden, False), (x,)),
            "default": autotp.parallelize(model, (x,)),
            "reference": autotp.parallelize(model, (x,), dropout="reference"),
        }
        torch.manual_seed(5)
        out = programs["reference"](x).logits
        out.float().logsumexp(-1).mean().backward()
        torch.manual_seed(5)
        want = model(x).logits
        want.float().logsumexp(-1).mean().backward()
        grads = autotp.full_state_dict(programs["reference"], grads=True)
        dropped, values = 0, 0

        def count(module, args, result):
            nonlocal dropped, values
            dropped += int(((result == 0) & (args[0] != 0)).sum())
            values += int((args[0] != 0).sum())

        hooks = [m.register_forward_hook(count) for m in random_ops(programs["default"]) if isinstance(m, Dropout)]
        programs["default"](x)
        for hook in hooks:
            hook.remove()
        seconds = {}
        for name, program in programs.items():
            _step(program, x)  # warm-up
            seconds[name] = statistics.median(_step(program, x) for _ in range(repeats))
        gradient = max(float((grads[n] - p.grad).abs().max()) for n, p in model.named_parameters())
        found[attention] = {
            "output": float((out - want).abs().max()),
            "gradient": gradient,
            "rate": dropped / values,
            "seconds": seconds,
        }
    return found


def main() -> None:
    from autotp.tools.spawn import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    o = parser.parse_args()
    print(describe("gloo"), datetime.date.today())
    print(f"GPT-2 {o.layers} layers, hidden {o.hidden}, 4 heads, dropout 0.1, batch 4 x 64 tokens, 2 ranks")
    for attention, r in run_local(2, _rank, o.layers, o.hidden, o.repeats, timeout=600)[0].items():
        s = r["seconds"]
        print(
            f"{attention:5s}  reference vs one process: output {r['output']:.1e}, gradients {r['gradient']:.1e};  "
            f"default drop rate {r['rate']:.4f};  training step ms: eval {s['eval'] * 1e3:.1f}, "
            f"default {s['default'] * 1e3:.1f}, reference {s['reference'] * 1e3:.1f}"
        )
        if max(r["output"], r["gradient"]) > 1e-4 or abs(r["rate"] - 0.1) > 0.05:
            raise SystemExit(f"{attention}: reference mode differs from one process, or the drop rate is off")


if __name__ == "__main__":
    main()
