"""The private torch APIs hyperfsdp-dcp uses, each with why (kept here so that a torch upgrade
that moves one breaks in one place)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout ``group`` was created with (``init_process_group(timeout=)`` or
    ``new_group(timeout=)``), or torch's default where it cannot be read.

    The checkpoint manager bounds its own waits (an async save at shutdown, the wait for the
    ranks of a failed save to report) by the training job's process-group timeout. torch
    has no public getter for it: it is only readable through the group's backend options.
    """
    try:
        if group is None:
            group = dist.group.WORLD
        timeout = group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError, TypeError):
        pass
    return dist.default_pg_timeout
