"""Capture and prepare: the model's ATen graph, rewritten into the forms the op table's rules read."""

from __future__ import annotations

import torch

from autotp.canonicalize import REWRITES
from autotp.passes.capture import CaptureError, canonical_names, capture
from autotp.passes.capture import check_inputs as check_example_inputs
from autotp.passes.fold import NotFoldable, find_fold, fold_graph, folded
from autotp.runtime.hf_models import default_inputs, no_kv_cache
from autotp.runtime.progress import step


def prepared_graph(model: torch.nn.Module, args=None, kwargs=None, fold: bool = False) -> torch.fx.GraphModule:
    """The captured graph, prepared for the rules.  ``fold=True``: a long list of identical blocks is captured as
    four of them (passes/fold.py; ``gm.meta["autotp_fold"]`` says how), for planning only -- never for running."""
    if args is None and kwargs is None:
        args = default_inputs(model)
    repeats = None
    if fold:
        check_example_inputs(model, args if args is not None else (), kwargs)  # clear errors before looking inside
        repeats = find_fold(model)
    if repeats is not None:
        try:
            with folded(model, repeats):
                gm = prepared_graph(model, args, kwargs)
            gm.meta["autotp_fold"] = fold_graph(gm, repeats)
            return gm
        except (CaptureError, NotFoldable):
            pass  # the forward needs every block (e.g. indexes the list), or they differ: capture them all
    with no_kv_cache(model), step(f"capturing {type(model).__name__} with torch.export"):
        gm = capture(model, args if args is not None else (), kwargs)
    with step("preparing the graph for the sharding rules"):
        return prepare(gm)


def prepare(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A captured graph (of a model, or of one pipeline stage: parallel/split.py) made ready for the rules: the
    canonical-form rewrites in their order (autotp/canonicalize), then its ops named in an order of the graph
    alone."""
    for rewrite in REWRITES:
        rewrite(gm)
    canonical_names(gm)
    return gm
