"""Activation memory as autograd holds it, to compare with what a plan estimates."""

from __future__ import annotations

import torch


def saved_bytes(module: torch.nn.Module, *inputs) -> int:
    """Bytes of the tensors autograd keeps during ``module(*inputs)``, each storage once; parameters,
    buffers and the inputs are not activations.  A sequence-parallel program stores the pieces of
    gathered tensors through its own hooks (autotp.runtime.activations): what those keep is counted."""
    from autotp.runtime import activations
    from autotp.runtime.activations import Recomputed

    held = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *inputs]}
    seen: dict = {}

    def count(stored):
        tensor = stored if isinstance(stored, torch.Tensor) else stored[0].piece  # regather: (_Kept, size, ...)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return stored

    pack = activations._pack
    activations._pack = lambda tensor: count(pack(tensor))

    # a recomputed piece (torch.utils.checkpoint) keeps its inputs, and nothing its ops save
    def count_inputs(mod, args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                count(arg)

    hooks = [m.register_forward_pre_hook(count_inputs) for m in module.modules() if isinstance(m, Recomputed)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            out = module(*inputs)
    finally:
        activations._pack = pack
        for hook in hooks:
            hook.remove()
    del out
    return sum(seen.values())
