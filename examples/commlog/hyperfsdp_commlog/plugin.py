"""Record every collective (kind, group size, bytes, unit); print a summary after each backward.

Off unless ``HYPERFSDP_COMMLOG`` is set when the model's first forward runs (then it
costs nothing). Written against ``hyperfsdp_core.plugin`` only, as any third party would.
"""

import collections
import os
import sys

from hyperfsdp_core.plugin import FIRST_PHASE, Phase, StashKey, hookimpl

HYPERFSDP_API = ">=1.0,<2"  # the plugin API versions this plugin was written for
ENV = "HYPERFSDP_COMMLOG"
EVENTS = StashKey[list]("commlog.events")


@hookimpl
def hyperfsdp_collective_observer(root):
    if not os.environ.get(ENV):
        return None
    events = root.stash[EVENTS] = []
    return events.append  # called with a CollectiveEvent per collective


def summarize(events) -> list[str]:
    """One line per (kind, group size, unit), in order of first use: count and bytes."""
    rows = collections.defaultdict(lambda: [0, 0])
    for e in events:
        row = rows[(e.kind, e.group_size, e.unit)]
        row[0] += 1
        row[1] += e.nbytes
    return [
        f"{kind:<14} group={size:<3} unit={'<root>' if unit == '' else unit:<10} n={n} bytes={nbytes}"
        for (kind, size, unit), (n, nbytes) in rows.items()
    ]


def print_summary(root) -> None:
    events = root.stash.get(EVENTS, None)
    if events:
        print(f"[commlog] {len(events)} collectives since the last summary:", file=sys.stderr)
        for line in summarize(events):
            print(f"[commlog]   {line}", file=sys.stderr)
        events.clear()


@hookimpl
def hyperfsdp_finalize_phases():
    later = ("dp.all_reduce", "tp.replicate_all_reduce", "offload.grads_to_host")
    return [Phase("commlog.summary", print_summary, after=FIRST_PHASE, after_if_present=later)]
