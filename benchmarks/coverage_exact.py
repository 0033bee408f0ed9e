"""The sweep's exactness part: a planned model run on gloo ranks against one process, fp32 rounding told apart
from a mismatch by float64."""

from __future__ import annotations

import re
import signal
import time

import torch
from coverage_build import alarm, build, first_line

TOL = {"rtol": 1e-4, "atol": 1e-5}  # the suite's (tests/helpers/exact.py)


def _leaves(out) -> list:
    from autotp.passes.faithful import float_leaves

    return float_leaves(out)


def _float64(model, kwargs) -> tuple[list | None, dict]:
    """The model's outputs and gradients in float64: the truth both fp32 runs round away from; (None, {}) where an
    op has no float64 kernel (grouped matmuls): a value off by more than TOL is then a mismatch, never rounding."""
    import copy

    exact = copy.deepcopy(model).double()
    for p in exact.parameters():
        p.grad = None  # a copy made after the fp32 backward holds its gradients
    try:
        out = _leaves(_seeded(exact, {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}))
        sum(x.square().mean() for x in out).backward()
    except RuntimeError:
        return None, {}
    return out, {n: p.grad for n, p in exact.named_parameters()}


def _rounding(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor) -> bool:
    """Off the one-process value by more than TOL, but about as far from float64 as one process is (at most 4 times
    its distance, plus atol): fp32 rounding of a long or ill-conditioned sum (a token's gradient summed over every
    position; BLIP's gradients of 1.8e10, 3.8e3 apart from float64 in one process), not a bug, which is orders of
    magnitude farther."""
    ours, theirs = _error(got.double(), truth), _error(want.double(), truth)
    return ours <= 4 * theirs + TOL["atol"]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() if want.numel() else 0.0  # a model may hold empty tensors (DINOv3)


def _seeded(model, kwargs):
    """The model's outputs with the random generator seeded: a model that samples in eval mode (VITS's noise)
    draws the same numbers in the sharded program and in one process."""
    torch.manual_seed(0)
    return model(**kwargs)


def _rank(rank: int, world: int, name: str, spec: dict, timeout: int) -> dict:
    import autotp

    model, kwargs, _ = build(name, "cpu", spec)
    sharded = autotp.parallelize(
        model,
        (),
        kwargs,
        timeout=timeout,  # rank 0 plans alone: the others wait
        **spec.get("options", {}),
    )
    got, want = (_leaves(_seeded(m, kwargs)) for m in (sharded, model))  # a model that samples (VITS) alike
    result = {"outputs": len(want), "out_err": 0.0, "grad_err": 0.0, "mismatch": None, "grads_off": [], "rounding": []}
    if len(got) != len(want):
        result["mismatch"] = f"{len(got)} float outputs, one process has {len(want)}"
        return result
    truth = None
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = _error(g, w) if g.shape == w.shape else float("inf")
        result["out_err"] = max(result["out_err"], err)
        if g.shape != w.shape or not torch.allclose(g, w, **TOL):
            truth = truth or _float64(model, kwargs)
            if g.shape == w.shape and truth[0] is not None and _rounding(g, w, truth[0][i]):
                result["rounding"].append(f"output {i}")
            else:
                result["mismatch"] = result["mismatch"] or f"output {i} {tuple(w.shape)}: max error {err:.3g}"
    sum(x.float().square().mean() for x in got).backward()
    sum(x.float().square().mean() for x in want).backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for n, p in model.named_parameters():
        if p.grad is None or grads.get(n) is None:
            continue
        err = _error(grads[n], p.grad)
        result["grad_err"] = max(result["grad_err"], err)
        if not torch.allclose(grads[n], p.grad, **TOL):
            truth = truth or _float64(model, kwargs)
            if n in truth[1] and _rounding(grads[n], p.grad, truth[1][n]):
                result["rounding"].append(n)
            else:
                result["mismatch"] = result["mismatch"] or f"grad {n}: max error {err:.3g}"
                result["grads_off"].append(n)
    return result


def exact_entry(name: str, spec: dict, timeout: int, world: int = 2) -> dict:
    from autotp.tools.spawn import run_local

    entry, start = {"name": name, "world": world}, time.perf_counter()
    alarm(timeout)
    try:
        result = run_local(world, _rank, name, spec, timeout, timeout=timeout)[0]
        entry.update(result, result="exact" if result["mismatch"] is None else "mismatch")
    except Exception as exc:  # a rank's error, raised here
        lines = [line.strip() for line in str(exc).splitlines()]
        refused = next((line for line in lines if "UnfaithfulCapture" in line), None)
        if refused:  # autotp's check of the capture said why, in one line
            entry.update(result="refused", error=refused[:400])
        else:  # the rank's own error: the last "...Error: ..." line of its traceback
            raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
            entry.update(result="crash", error=raised[-1][:300] if raised else first_line(exc))
    finally:
        signal.alarm(0)
        entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry
