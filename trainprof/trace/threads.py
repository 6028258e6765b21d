"""Which thread of a trace is the training loop's: one rule for every analysis."""

from __future__ import annotations

import numpy as np


def main_thread(ev) -> int | None:
    """The host thread with the most ProfilerStep spans (the GPU timeline repeats them as
    gpu_user_annotation, which do not count); in a window without ProfilerStep (a whole-trace
    window) the thread with the most CPU ops; the smallest tid on ties; None when neither."""
    m = ev["name"].startswith("ProfilerStep#") & ~ev["is_gpu"]
    if not m.any():
        m = ev["cat"].eq("cpu_op")
    if not m.any():
        return None
    tids, counts = np.unique(ev["tid"][m], return_counts=True)
    return int(tids[np.argmax(counts)])
