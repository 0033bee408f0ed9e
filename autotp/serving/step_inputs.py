"""A step's program calls, built from the scheduler's runs: shapes that depend on the batch bucket only.

The one-token rows (decodes) make one call padded to a batch-size bucket (vLLM's capture sizes: 1, 2, 4, 8, ...
up to ``max_num_seqs``), their block tables padded to the longest a sequence may hold, so a decode call has one
of a few shapes whatever runs: the graphs of serving/decode_graphs.py are made once a bucket.  A padding row runs
token 0 at position 0, writes to the scratch block (which no table of a sequence lists) and reads it.  Prompt
chunks make a second call, their rows padded on the left to the longest chunk and their tables to the longest
context among them (a chunk's sizes are the step's, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.serving.scheduler import Run


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_seqs)


@dataclass(frozen=True)
class StepLayout:
    block_size: int
    scratch_block: int  # the block padding writes to and reads: no sequence owns it
    table_width: int  # blocks of the longest sequence: every decode row's table is this wide
    buckets: tuple[int, ...]

    def bucket(self, rows: int) -> int:
        return next(size for size in self.buckets if size >= rows)


def step_calls(runs: list[Run], layout: StepLayout) -> list[tuple[tuple, list]]:
    """(inputs, rows) of each call: the decodes padded to their bucket, then the prompt chunks; ``rows`` lists each
    row's run, None for padding."""
    decodes, chunks = [r for r in runs if r.count == 1], [r for r in runs if r.count > 1]
    calls = []
    if decodes:
        rows = decodes + [None] * (layout.bucket(len(decodes)) - len(decodes))
        calls.append((_inputs(rows, 1, layout.table_width, layout), rows))
    if chunks:
        tokens = max(r.count for r in chunks)
        width = -(-max(r.start + r.count for r in chunks) // layout.block_size)
        calls.append((_inputs(chunks, tokens, width, layout), chunks))
    return calls


def _inputs(rows: list[Run | None], tokens: int, width: int, layout: StepLayout) -> tuple:
    """(ids, positions, slots: [rows, tokens]; block tables: [rows, width]), int64 on the host.  A row is padded on
    the left to ``tokens`` (each row's last token gives its logits), its table on the right with the scratch block."""
    size, scratch = layout.block_size, layout.scratch_block
    ids, positions, slots, tables = [], [], [], []
    for r in rows:
        if r is None:
            ids.append([0] * tokens)
            positions.append([0] * tokens)
            slots.append([scratch * size] * tokens)
            tables.append([scratch] * width)
            continue
        blocks, pad = r.sequence.blocks, tokens - r.count
        ids.append([0] * pad + r.sequence.tokens[r.start : r.start + r.count])
        positions.append([0] * pad + list(range(r.start, r.start + r.count)))
        slots.append(
            [scratch * size] * pad + [blocks[p // size] * size + p % size for p in range(r.start, r.start + r.count)]
        )
        tables.append(blocks[:width] + [scratch] * (width - min(width, len(blocks))))
    return tuple(torch.tensor(x, dtype=torch.long) for x in (ids, positions, slots, tables))
