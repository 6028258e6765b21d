"""Which ranks profile (probes/profile_ranks.py): per-coordinate and per-node covers, auto, lists,
keywords, bad specs."""

from __future__ import annotations

import itertools

import pytest

from trainprof.probes import profile_ranks as pr


def coords(rank: int, shape: list[int]) -> tuple:
    out = []
    for s in reversed(shape):
        out.append(rank % s)
        rank //= s
    return tuple(out[::-1])


def test_per_coord_covers_every_stage_and_shard_of_a_3d_mesh():
    shape = [4, 2, 2]  # dp4 x pp2 x tp2, init_device_mesh's row-major layout
    chosen, policy = pr.select("per-coord", 16, mesh_shape=shape)
    assert policy == "per-coord"
    # the lines through rank 0: a whole dp group, a whole pipeline, a whole tp group
    assert chosen == [0, 1, 2, 4, 8, 12] and len(chosen) == pr.star_size(shape) == 6
    for dim, size in enumerate(shape):
        assert {coords(r, shape)[dim] for r in chosen} == set(range(size))
    assert sorted(r for r in chosen if coords(r, shape)[0] == 0) == [0, 1, 2]  # pp0,pp1 and tp0,tp1


@pytest.mark.parametrize("shape", [[8], [2, 4], [4, 2, 2], [2, 2, 2, 3], [1, 16, 1]])
def test_per_coord_covers_every_coordinate_of_every_dimension(shape):
    world = 1
    for s in shape:
        world *= s
    chosen, _ = pr.select("per-coord", world, mesh_shape=shape)
    assert len(chosen) == sum(shape) - len(shape) + 1
    for dim, size in enumerate(shape):
        assert {coords(r, shape)[dim] for r in chosen} == set(range(size))


def test_per_node_and_the_fallback_without_a_mesh():
    local = lambda r: r % 8  # noqa: E731 - 8 ranks per host
    chosen, policy = pr.select("per-node", 64, local_rank_of=local)
    assert chosen == list(range(0, 64, 8)) and policy == "per-node"
    # per-coord without a DeviceMesh: per-node plus rank 0 (rank 0 even with no local rank known)
    chosen, policy = pr.select("per-coord", 64, local_rank_of=local)
    assert chosen == list(range(0, 64, 8)) and policy == "per-node"
    assert pr.select("per-coord", 4)[0] == [0]
    # a mesh that does not cover the world is not used
    assert pr.decide("per-coord", 5, 32, 5, {"shape": [2, 2], "coord": [0, 1]}) == (False, "per-node")


def test_auto_all_up_to_64_then_a_covering_subset():
    assert pr.select("auto", 64)[0] == list(range(64))
    local = lambda r: r % 8  # noqa: E731
    chosen, policy = pr.select("auto", 1024, local_rank_of=local, mesh_shape=[32, 4, 8])
    assert policy == "per-coord" and len(chosen) == 32 + 4 + 8 - 2
    # a pure data-parallel mesh of 1024: per-coord would be every rank, so per-node
    chosen, policy = pr.select("auto", 1024, local_rank_of=local, mesh_shape=[1024])
    assert policy == "per-node" and len(chosen) == 128
    chosen, policy = pr.select(None, 1024, local_rank_of=local)
    assert policy == "per-node" and chosen == list(range(0, 1024, 8))


def test_lists_keywords_and_bad_specs():
    assert pr.select("0,3,8-10", 16) == ([0, 3, 8, 9, 10], "list")
    assert pr.select("none", 8) == ([], "none") and pr.select("ALL", 3) == ([0, 1, 2], "all")
    assert pr.canonical(" 8-10, 3,0,9 ") == "0,3,8-10" and pr.canonical("") == "auto"
    assert pr.canonical("per_node") == "per-node"
    for bad in ("x", "3-1", "1,,2", "-1", "1-", "per-host"):
        with pytest.raises(ValueError):
            pr.parse(bad)
    from trainprof.rankranges import ranges

    assert ranges([0, 1, 2, 5, 8, 9]) == "0-2,5,8-9"


def test_every_rank_agrees_with_the_set_computed_for_the_job():
    shape = [2, 2, 2]
    expected, _ = pr.select("per-coord", 8, mesh_shape=shape)
    for r, c in zip(range(8), itertools.product(range(2), range(2), range(2))):
        ok, _ = pr.decide("per-coord", r, 8, r % 4, {"shape": shape, "coord": list(c)})
        assert ok == (r in expected)


def test_a_wide_rank_range_costs_nothing_in_the_ranks():
    """"0-16777215" (accepted: below MAX_RANK) was expanded into a set of 16.7M ranks in every
    rank, twice, just before the profiler window: 28 s and 2.5 GB per rank here. Intervals now."""
    import time

    t0 = time.perf_counter()
    spec = pr.canonical("0-16777215")
    ok = [pr.decide(spec, r, 1 << 24, 0, None)[0] for r in (0, 5_000_000, (1 << 24) - 1)]
    assert time.perf_counter() - t0 < 1.0
    assert spec == "0-16777215" and ok == [True, True, True]
    assert pr.canonical("9-12, 0-5,3-9 ,14,13") == "0-14"
    assert pr.select("100-200000,7", 10) == ([7], "list")
    assert pr.parse("1,3") == pr.parse("3,1") != pr.parse("1-3")
