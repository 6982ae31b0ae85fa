"""Mixed precision (FSDP2's MixedPrecisionPolicy) as a builtin plugin.

It only decides dtypes and casts module inputs/outputs; the core's buckets then
all-gather in ``param_dtype`` and reduce in ``reduce_dtype``. Units without a
policy get no callables, so they pay nothing per step.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hyperfsdp_core.plugin import UnitSpec, hookimpl

from ._torch_private import tree_map


def _cast(dtype: torch.dtype, x):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


@hookimpl
def hyperfsdp_param_dtypes(unit: UnitSpec, param: nn.Parameter):
    policy = unit.mp_policy
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    if not param.is_floating_point():
        return None
    param_dtype = policy.param_dtype or param.dtype
    return param_dtype, policy.reduce_dtype or param_dtype


@hookimpl
def hyperfsdp_forward_input_transform(unit):
    policy = unit.mp_policy
    if policy is None or not policy.cast_forward_inputs or policy.param_dtype is None:
        return None
    cast = partial(_cast, policy.param_dtype)

    def cast_inputs(args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return cast_inputs


@hookimpl
def hyperfsdp_forward_output_transform(unit):
    policy = unit.mp_policy
    if policy is None or policy.output_dtype is None:
        return None
    return partial(tree_map, partial(_cast, policy.output_dtype))
