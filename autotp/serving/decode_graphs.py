"""Decode steps replayed, not rebuilt: one graph per shape of a step's inputs (a batch-size bucket).

A sharded program runs every op from Python, one kernel launch (and one collective) at a time; a decode step of a
large model is launch-bound unless it is replayed as a graph, as vLLM and SGLang replay one CUDA graph per batch
bucket.  ``StepGraphs`` calls a program on inputs of a few fixed shapes (static buffers, padded to a bucket):

- the first call of a shape runs the program as it is (its input checks, a recapture if the first capture cannot
  take these shapes);
- the next ones run ``torch.compile(fullgraph=True, dynamic=False)`` of the program's own forward (one graph a
  shape, counted in ``compiled``), where a backend is given;
- on a GPU whose group carries its collectives itself (NCCL; gloo copies CUDA tensors through the host, which no
  graph can hold) each shape is captured once into a ``torch.cuda.CUDAGraph`` on the caller's thread (the engine's
  own) and replayed: the inputs are copied into the graph's static buffers, and the output is the graph's static
  tensor, which the caller reads before its next call overwrites it.

A step writes its keys and values into the cache at its own positions, so the warm-up run before a capture writes
what the replay writes again: running a step twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.runtime.devices import graph_capturable
from autotp.runtime.programs import refusal


@dataclass(frozen=True)
class CompileOptions:
    """How decode steps are compiled and replayed."""

    backend: str | None = "inductor"
    """torch.compile's backend for each bucket's graph ("eager" and "aot_eager" compile in a blink: tests); None:
    the program as it is (on a GPU still captured into a CUDA graph)."""
    cuda_graphs: bool = True
    """On a GPU group with collectives of its own (NCCL): each bucket captured once as a CUDA graph and replayed."""


class StepGraphs:
    """``program(*inputs)``, compiled and (on a GPU group) captured once for each shape of ``inputs``."""

    def __init__(self, program: torch.nn.Module, options: CompileOptions, group, device: torch.device):
        self.program, self.options = program, options
        self.capture = options.cuda_graphs and graph_capturable(group, device)
        forward = type(program).forward  # the program's own code: its compiled graphs are its own
        self.step = (
            forward
            if options.backend is None
            else torch.compile(forward, backend=self._counted, fullgraph=True, dynamic=False)
        )
        self.shapes: dict[tuple, bool] = {}  # shape -> whether the first program takes it (else: run it as it is)
        self.replays: dict[tuple, tuple] = {}  # shape -> (static inputs, CUDA graph, static output)
        self.pool = None  # one memory pool for every CUDA graph (buckets never run at once)
        self.compiled = 0  # graphs torch.compile made
        self.captured = 0  # CUDA graphs captured

    def _counted(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiled += 1
        return torch._dynamo.lookup_backend(self.options.backend)(gm, example_inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        shape = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if shape not in self.shapes:  # first: as the program runs, and whether its own forward takes these inputs
            self.shapes[shape] = refusal(self.program, inputs, {}) is None
            return self.program(*inputs)
        if not self.shapes[shape]:
            return self.program(*inputs)
        if self.capture:
            return self._replay(shape, inputs)
        if shape not in self.replays:  # the first compiled call of this shape: no recompile limit stops it
            self.replays[shape] = ()
            with torch._dynamo.config.patch(recompile_limit=max(8, 2 * len(self.shapes))):
                return self.step(self.program, *inputs)
        return self.step(self.program, *inputs)

    def _replay(self, shape: tuple, inputs: tuple) -> torch.Tensor:
        if shape not in self.replays:
            self.replays[shape] = self._captured(inputs)
        static, graph, output = self.replays[shape]
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return output

    def _captured(self, inputs: tuple) -> tuple:
        """(static inputs, graph, static output): warmed up on a side stream (compiles, allocates workspaces),
        then captured into the shared pool."""
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch._dynamo.config.patch(recompile_limit=max(8, 2 * len(self.shapes))):
            self.step(self.program, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.step(self.program, *static)
        self.pool = graph.pool()
        self.captured += 1
        return static, graph, output
