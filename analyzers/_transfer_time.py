"""A blocking collective's own time past its last member's arrival, from the collective log.

On a loaded CPU host the time a gloo collective takes once every member has entered it is the
transfer plus however long the ranks' gloo threads waited for a core. What it takes when no host
delays it — its own time — is a low quantile (``_lateness.TRANSFER_QUANTILE``) of that remainder
over the group's instances of the same op and about the same size: a slow link makes every
instance slow, so its quantile is as long and the time stays communication.

"About the same size", not the same size: an expert-parallel all_to_all moves however many tokens
the router sent that step, so each of its instances has its own byte count (a balanced 2-rank MoE
job: 485,376, 498,688, 504,832, ... B) and no size has enough instances for a quantile. The pool
of a record is every instance of its group and op within an octave of its size (sizes put in
``BINS_PER_OCTAVE`` bins per doubling; the pool spans ±``BINS_PER_OCTAVE`` bins), a smaller
instance's time scaled up by the size ratio (bins apart), a larger one's taken as it is: an
upper bound of the record's own time either way when time grows with size, so only time surely
not the transfer is left out. A 16 B count exchange is not judged by a 512 KiB transfer.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers._lateness import TRANSFER_MIN_RECORDS, TRANSFER_QUANTILE

BINS_PER_OCTAVE = 8


def own_time(group, op, nbytes, after) -> np.ndarray:
    """Per record (arrays of one length): its op's own time in ms, the TRANSFER_QUANTILE of
    ``after`` (ms past the last member's arrival) over the records of the same ``group`` and
    ``op`` within an octave of its size (≥ TRANSFER_MIN_RECORDS of them, else inf: nothing is
    left out); inf where the size is unknown."""
    after = np.asarray(after, float)
    out = np.full(len(after), np.inf)
    b = pd.to_numeric(pd.Series(np.asarray(nbytes, dtype=object)), errors="coerce").to_numpy(float)
    known = np.isfinite(b) & np.isfinite(after)
    if not known.any():
        return out
    idx = np.flatnonzero(known)
    bins = np.floor(BINS_PER_OCTAVE * np.log2(np.maximum(b[idx], 1.0))).astype(np.int64)
    keys = pd.MultiIndex.from_arrays([pd.Series(np.asarray(group, dtype=object)[idx]).astype(str),
                                      pd.Series(np.asarray(op, dtype=object)[idx]).astype(str)])
    codes, _ = pd.factorize(keys)
    order = np.lexsort((bins, codes))
    codes, bins, vals, idx = codes[order], bins[order], after[idx][order], idx[order]
    cuts = np.flatnonzero(np.diff(codes)) + 1
    for lo_k, hi_k in zip(np.r_[0, cuts], np.r_[cuts, len(codes)]):
        kb, kv, ki = bins[lo_k:hi_k], vals[lo_k:hi_k], idx[lo_k:hi_k]
        for u in np.unique(kb):
            lo = np.searchsorted(kb, u - BINS_PER_OCTAVE, "left")
            hi = np.searchsorted(kb, u + BINS_PER_OCTAVE, "right")
            if hi - lo < TRANSFER_MIN_RECORDS:
                continue
            scale = np.maximum(1.0, 2.0 ** ((u - kb[lo:hi]) / BINS_PER_OCTAVE))
            out[ki[np.searchsorted(kb, u, "left"):np.searchsorted(kb, u, "right")]] = np.quantile(kv[lo:hi] * scale, TRANSFER_QUANTILE)
    return out
