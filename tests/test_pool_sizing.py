"""The KV pool sized for what runs (serving/pool_sizing.py): vLLM's --gpu-memory-utilization over the memory a
profiling step and the graphs took; the profiling step itself runs in tests/test_decode_graphs.py's engine."""

from __future__ import annotations

import argparse

import pytest


def test_the_pool_is_the_share_of_the_device_that_a_step_leaves():
    """80 GiB at 0.9: 72 GiB less the peak a profiling step reached (weights 16 GiB, activations 3 GiB, graphs
    1 GiB, the profiling pool's 2 GiB given back) less 0.5 GiB outside torch: 51.5 GiB, 1,648 blocks of 32 MiB."""
    from autotp.serving.pool_sizing import MemoryUse, blocks_in, kv_cache_bytes

    gib = 2**30
    use = MemoryUse(total=80 * gib, peak=(16 + 3 + 1 + 2) * gib, profiling_pool=2 * gib, outside=gib // 2)
    assert kv_cache_bytes(use, 0.9) == int(0.9 * 80 * gib) - 20 * gib - gib // 2 == int(51.5 * gib)
    assert blocks_in(kv_cache_bytes(use, 0.9), 32 * 2**20) == 1648
    assert kv_cache_bytes(use, 0.25) < 0
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.25 holds no block"):
        blocks_in(kv_cache_bytes(use, 0.25), 32 * 2**20, "--gpu-memory-utilization 0.25")


def test_a_block_holds_every_layers_keys_and_values_of_a_ranks_kv_heads():
    """LLaMA-3-8B's shape: 32 layers, 8 KV heads of 128, bf16, blocks of 16: 2 MiB a block on one rank, 256 KiB a
    rank at TP 8, and 3 KV heads of 8 at TP 3 (rounded up)."""
    from types import SimpleNamespace

    from autotp.serving.pool_sizing import block_bytes

    config = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    config.head_dim = 128
    assert block_bytes(config, 16, 1, 2) == 2 * 2**20
    assert block_bytes(config, 16, 8, 2) == 2**18
    assert block_bytes(config, 16, 3, 2) == 3 * 2**18


def test_gpu_memory_utilization_is_parsed_as_vllm_spells_it():
    from autotp.tools.serve import ServeOptions, add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), int)

    def options(*flags: str) -> ServeOptions:
        args = vars(parser.parse_args(["serve", "m", *flags]))
        given = {k: v for k, v in args.items() if k in ServeOptions.__dataclass_fields__}
        return ServeOptions(**given | {"world_size": 1})

    assert options().gpu_memory_utilization == 0.9
    assert options("--gpu-memory-utilization", "0.5").gpu_memory_utilization == 0.5
    for wrong in (
        ["--gpu-memory-utilization", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "x"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", *wrong])
    with pytest.raises(SystemExit):  # a pool of a given size is not sized again
        parser.parse_args(["serve", "m", "--kv-blocks", "8", "--gpu-memory-utilization", "0.5"])
