"""Each placement conversion and its gradient, against the full tensors, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from autotp.placement import P, R, Shard, assemble, parse, take_local
from autotp.runtime import collectives, transport
from tests.helpers.distributed import comm_counts, run_ranks

# even, fused blocks, dim 0, whole units (uneven at 4 ranks: 2,2,1,1), units shared by ranks (grouped at 4),
# 3 KV heads for 6 query heads (held 0-1, 1-2 at 2 ranks; 0, 1, 2, 2 at 4), fused [4 query heads | 1 KV | 1 KV],
# [4 query heads | 1 KV | 1 KV] per group for 3 groups (12 query heads: at 4 ranks, rank 1's heads 3-5 span
# groups 0 and 1, so it holds both groups' KV)
SHARDS = [
    Shard(1),
    Shard(1, (4, 8, 12)),
    Shard(0),
    Shard(1, units=6),
    Shard(1, units=2),
    Shard(1, units=3, of=6),
    Shard(1, (12, 6, 6), (4, 1, 1), of=4),
    Shard(1, (4, 2, 2), (4, 1, 1), of=12, groups=3),
]


def _conversions(rank: int, world: int, gloo_paths: bool) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    if gloo_paths:  # one-shot small all-reduces and polled eager collectives, as parallelize sets up on gloo
        transport.register(dist.group.WORLD)
    torch.manual_seed(0)
    summands = [torch.randn(8, 24, dtype=torch.float64) for _ in range(world)]  # same on every rank
    full = sum(summands)
    pieces = [torch.randn(8, 24, dtype=torch.float64) for _ in range(world)]
    upstream = sum(pieces)  # d(loss)/d(full), same on every rank
    have = {R: full, P: summands[rank], **{s: take_local(full, s, rank, world) for s in SHARDS}}
    for src in [P, R, *SHARDS]:
        for dst in [R, *SHARDS]:
            for partial_grad in (False, True):
                if partial_grad and dst != R:
                    continue
                x = have[src].clone().requires_grad_()
                y = x
                for fn, extra in collectives.conversion_steps(src, dst, full.shape, rank, world, group, partial_grad):
                    y = fn(y, *extra)
                torch.testing.assert_close(y, have[dst], msg=lambda m, s=src, d=dst: f"{s}->{d}: {m}")
                assert y.is_contiguous(), (src, dst)  # a gathered or scattered view would slow every later op
                (y * _grad_for(dst, upstream, pieces, partial_grad, rank, world)).sum().backward()
                # the gradient of the source value, reassembled in full, is the upstream gradient
                got = x.grad
                if isinstance(src, Shard):
                    got = collectives._gather_grads(got, src, full.shape[src.dim], rank, world, group, "test")
                torch.testing.assert_close(
                    got, upstream, msg=lambda m, s=src, d=dst, f=partial_grad: f"grad {s}->{d} (partial {f}): {m}"
                )


def _grad_for(dst, upstream, pieces, partial_grad: bool, rank: int, world: int):
    """The gradient each rank feeds back: partial sums, or its slice (a grouped slice's owner only)."""
    if partial_grad:
        return pieces[rank]
    if not isinstance(dst, Shard):
        return upstream
    return collectives._owners_share(take_local(upstream, dst, rank, world), dst, upstream.shape[dst.dim], rank, world)


@pytest.mark.parametrize("gloo_paths", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_conversions_and_their_gradients(world, gloo_paths):
    run_ranks(world, _conversions, gloo_paths)


def test_take_local_and_assemble_invert_each_other():
    full = torch.arange(2 * 24).view(2, 24)
    for shard in [s for s in SHARDS if s.dim == 1]:
        for world in (1, 2, 3, 4):
            uneven_blocks = shard.units is None and any(c % world for c in shard.chunks or ())
            if (shard.units == 2 and world == 3) or uneven_blocks:
                continue  # layouts the rules never offer
            parts = [take_local(full, shard, r, world) for r in range(world)]
            assert torch.equal(assemble(parts, shard, 24), full)


def test_uneven_and_grouped_pieces():
    """10 heads on 4 ranks: 3,3,2,2; 2 KV heads on 4 ranks: each held by two neighbours."""
    heads = torch.arange(10)
    assert [take_local(heads, Shard(0, units=10), r, 4).tolist() for r in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
        [8, 9],
    ]
    kv = torch.arange(2 * 3)  # 2 heads of 3 rows
    assert [take_local(kv, Shard(0, units=2), r, 4).tolist() for r in range(4)] == [
        [0, 1, 2],
        [0, 1, 2],
        [3, 4, 5],
        [3, 4, 5],
    ]
    assert [Shard(0, units=2).claims(6, r, 4) for r in range(4)] == [[(0, 3)], [(3, 0)], [(0, 3)], [(3, 0)]]
    # 8 query heads on 3 ranks (3,3,2) with 2 KV heads: each rank holds the KV heads its query heads use
    assert [take_local(kv, Shard(0, units=2, of=8), r, 3).tolist() for r in range(3)] == [
        [0, 1, 2],
        [0, 1, 2, 3, 4, 5],
        [3, 4, 5],
    ]
    assert str(Shard(2, (64, 16, 16), (8, 2, 2), 8)) == "S(2|64,16,16/8,2,2@8)"
    assert parse("S(2|64,16,16/8,2,2@8)") == Shard(2, (64, 16, 16), (8, 2, 2), 8)


def _one_shot(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    small, large = torch.randn(3, 5), torch.randn(transport.ONE_SHOT_BYTES // 4)  # large: over the limit
    want = {}
    for name, x in (("small", small), ("large", large)):
        want[name] = x.clone()
        dist.all_reduce(want[name])
    transport.register(dist.group.WORLD)
    for name, x, op in (("small", small, "all_gather_into_tensor"), ("large", large, "all_reduce")):
        with CommDebugMode() as comm:
            got = transport.all_reduce(x, group, "test")
        assert comm_counts(comm) == {op: 1}, name
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
        copies = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(copies, got)
        assert all(torch.equal(c, got) for c in copies), name  # replicated values are bit-identical


@pytest.mark.parametrize("world", [2, 3])
def test_small_all_reduces_on_gloo_are_one_shot(world):
    """vLLM's one-shot all-reduce for small messages: gathered, summed in rank order on every rank."""
    run_ranks(world, _one_shot)


def _gloo_shortcuts_without_affinity(rank: int, world: int) -> None:
    """No sched_getaffinity (macOS): every core counts; one core for two ranks, or no sched_yield: no polling.
    The sums stay right on each path (one-shot and ring all-reduce)."""
    import os

    import torch.distributed as dist

    group = dist.group.WORLD
    small, large = torch.full((3, 5), float(rank)), torch.full((transport.ONE_SHOT_BYTES // 4,), float(rank))
    del os.sched_getaffinity
    for patch, polls in ((None, world <= os.cpu_count()), ("one core", False), ("no sched_yield", False)):
        if patch == "one core":
            os.sched_getaffinity = lambda pid: {0}
        if patch == "no sched_yield":
            del os.sched_yield
        transport.register(group)
        assert transport._gloo[group.group_name].poll == polls, patch
        for x in (small, large):
            assert torch.equal(transport.all_reduce(x, group.group_name, "test"), torch.full_like(x, 1.0)), patch


def test_gloo_shortcuts_fall_back_without_affinity_or_cores():
    run_ranks(2, _gloo_shortcuts_without_affinity)


def test_a_polled_wait_gives_up_after_the_process_groups_timeout():
    class Pending:
        def is_completed(self):
            return False

    with pytest.raises(TimeoutError, match=r"process group's timeout \(0 s\)"):
        transport.wait(Pending(), transport.Gloo(world=2, poll=True, timeout=0.05))
