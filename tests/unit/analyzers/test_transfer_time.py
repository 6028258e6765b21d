"""A collective's own time past its last arrival: the 10th percentile over the instances of its
group and op within an octave of its size, smaller ones scaled up (analyzers/_transfer_time.py)."""

from __future__ import annotations

import numpy as np
import pytest

from trainprof.analyzers._transfer_time import own_time


def test_instances_of_about_the_same_size_are_pooled_smaller_ones_scaled_up():
    """Five 1000 B instances take 10 ms past the last arrival, one of 1900 B 50 ms. 1000 B and
    1900 B lie 8 bins apart (floor(8 log2 b) = 79 and 87: one octave): pooled. For the 1000 B
    ones the 1900 B one counts as it is: 10th percentile of [10 ×5, 50] = 10. For the 1900 B one
    the 1000 B ones count scaled by 2^(8/8) = 2: of [20 ×5, 50], 20 (its own 50 ms: 30 ms of
    host delay)."""
    t = own_time(["0"] * 6, ["all_to_all"] * 6, [1000] * 5 + [1900], [10.0] * 5 + [50.0])
    assert t.tolist() == pytest.approx([10.0] * 5 + [20.0])


def test_other_sizes_groups_and_ops_are_not_pooled():
    """A 16 B count exchange is not judged by 512 KiB transfers (15 octaves apart), nor an
    all_to_all by all_reduces or another group's: each has < 5 instances, nothing is left out
    (inf); five 512 KiB ones get their own 10th percentile; an unknown size gets inf."""
    group = ["0"] * 5 + ["0", "0", "1", "0"]
    op = ["all_to_all"] * 5 + ["all_to_all", "all_reduce", "all_to_all", "all_to_all"]
    nbytes = [524288] * 5 + [16, 524288, 524288, None]
    t = own_time(group, op, nbytes, [1.0, 2.0, 3.0, 4.0, 5.0, 0.1, 0.1, 0.1, 0.1])
    assert t[:5].tolist() == pytest.approx([np.quantile([1, 2, 3, 4, 5], 0.1)] * 5)
    assert np.isinf(t[5:]).all()
