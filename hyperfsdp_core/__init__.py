"""hyperfsdp: fully sharded data parallelism for PyTorch (a drop-in ``fully_shard``)."""

from .api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from .drop_in import use_as_fsdp2
from .module import FSDPModule, UnshardHandle
from .plugin.manager import get_plugin_manager, hookimpl
from .policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "get_plugin_manager",
    "hookimpl",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "use_as_fsdp2",
]
