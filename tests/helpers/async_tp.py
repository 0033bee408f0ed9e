"""What inductor's micro-pipeline TP pass (asynchronous TP) fuses in a compiled program, counted on the CPU, and the
torchtitan-style DTensor plan it is compared with (tests/test_async_tp.py).

The pass runs on NCCL groups with symmetric memory only: here it runs on a copy of every graph inductor compiles
(forward and backward, after its own post-grad passes) with both reported available, on a fake process group
standing for one rank of ``world``; the copy is counted, the compiled program itself is left alone."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

from autotp.tools.spawn import exit_quietly, local_context

FUSED = {
    "all_gather_matmul": torch.ops.symm_mem.fused_all_gather_matmul.default,
    "matmul_reduce_scatter": torch.ops.symm_mem.fused_matmul_reduce_scatter.default,
}


class _CountFusions(CustomGraphPass):
    """Inductor's post-grad custom pass: the micro-pipeline TP pass on a copy, its fused ops counted per graph."""

    def __init__(self):
        self.totals: dict = {"forward": Counter(), "backward": Counter()}

    def __call__(self, graph: torch.fx.Graph) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._inductor.fx_passes import micro_pipeline_tp

        copied = copy.deepcopy(graph.owning_module).graph
        with (
            mock.patch.object(dist, "is_nccl_available", lambda: True),
            mock.patch.object(symm_mem, "is_symm_mem_enabled_for_group", lambda group: True),
        ):
            micro_pipeline_tp.micro_pipeline_tp_pass(copied)
        fused = Counter({name: sum(n.target is op for n in copied.nodes) for name, op in FUSED.items()})
        self.totals["backward" if micro_pipeline_tp._is_backward(graph) else "forward"].update(fused)

    def uuid(self) -> None:  # never cached: every compile runs it
        return None


@contextlib.contextmanager
def counting_compile(module: torch.nn.Module):
    """Within: (``torch.compile(module)``, {"forward": Counter, "backward": Counter}), the pairs the pass fuses in
    every graph compiled meanwhile (graph breaks allowed: every graph counts; a backward compiles at its first
    run)."""
    counting = _CountFusions()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=counting, fx_graph_cache=False):
        yield torch.compile(module), counting.totals


def fused_pairs(module: torch.nn.Module, x: torch.Tensor) -> dict:
    """{"forward": Counter, "backward": Counter} of the collective-matmul pairs the pass fuses in the graphs of one
    compiled training step of ``module``."""
    with counting_compile(module) as (compiled, totals):
        out = compiled(x)
        out = getattr(out, "logits", out)
        (out.full_tensor() if hasattr(out, "full_tensor") else out).float().square().mean().backward()
    return totals


def hand_plan(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """torchtitan's LLaMA plan with sequence parallelism, on a Hugging Face LLaMA or Mixtral: q/k/v and gate/up
    column-parallel, o/down row-parallel into token pieces, norms sequence-parallel, the embedding row-parallel
    into token pieces, the head column-parallel from them; a mixture-of-experts block (no expert plan in DTensor's
    hand-written styles) computes whole on every rank from the gathered tokens and keeps this rank's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tokens = Shard(1)
    gathered = {"input_layouts": (tokens,), "desired_input_layouts": (Replicate(),), "use_local_output": True}
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=tokens, use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate()),
        },
    )
    for block in model.model.layers:
        plan = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": tokens},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=tokens, use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(**gathered),
        }
        if hasattr(block.mlp, "down_proj"):
            plan |= {
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=tokens, use_local_output=False),
            }
        else:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(tokens,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(tokens,),
                use_local_output=False,
            )
        parallelize_module(block, mesh, plan)
    return model


def in_fake_world(world: int, fn, *args):
    """``fn(*args)`` in a fresh process that stands for rank 0 of ``world`` ranks (a fake process group: collectives
    are traced and compiled, never run), and what it returns."""
    ctx = local_context()
    queue = ctx.Queue()
    process = ctx.Process(target=_fake_rank, args=(world, fn, args, queue))
    process.start()
    ok, result = queue.get(timeout=1800)
    process.join(timeout=60)
    if not ok:
        raise AssertionError(result)
    return result


def _fake_rank(world: int, fn, args, queue) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        queue.put((True, fn(*args)))
    except Exception:  # reported to the test, which raises it
        import traceback

        queue.put((False, traceback.format_exc()))
    queue.close()
    queue.join_thread()
    exit_quietly()
