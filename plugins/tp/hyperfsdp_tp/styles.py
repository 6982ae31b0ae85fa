"""Helpers for models parallelized with ``parallelize_module`` before ``fully_shard``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module


def replicate_module(
    module: nn.Module, tp_mesh: DeviceMesh, *, use_local_output: bool = True
) -> nn.Module:
    """Make ``module``'s parameters ``Replicate()`` DTensors on ``tp_mesh``.

    For modules that compute on replicated activations (norms without sequence
    parallelism): a ``fully_shard`` unit's parameters must be all DTensors or all plain
    tensors, and a block's linear layers are DTensors once tensor parallel. Plain tensor
    inputs become ``Replicate()`` DTensors; outputs become local tensors again unless
    ``use_local_output=False``. Returns ``module``.
    """

    def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, (Replicate(),), run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod: nn.Module, out, mesh: DeviceMesh):
        if use_local_output and isinstance(out, DTensor):
            return out.to_local()
        return out

    return distribute_module(module, tp_mesh, input_fn=inputs, output_fn=outputs)
