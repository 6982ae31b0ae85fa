"""Multi-rank testing for hyperfsdp and its plugins (also a pytest plugin).

``run_on_ranks(world_size, fn, *args)`` runs the module-level function ``fn`` on
``world_size`` CPU processes that share a gloo default process group, and returns
each rank's return value. Processes are kept alive between calls.
"""

from .pool import RankFailure, RankTimeout, close_pools, current_rank, run_on_ranks

__all__ = ["RankFailure", "RankTimeout", "close_pools", "current_rank", "run_on_ranks"]
