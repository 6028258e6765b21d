"""Which ranks record a profiler trace (`trainprof wrap --profile-ranks SPEC`,
TRAINPROF_PROFILE_RANKS).

Every rank decides for itself, from facts it has locally (its rank, local rank, the world size
and its DeviceMesh coordinate), so the decision costs no communication and all ranks agree.

SPEC:
  ``all``        every rank
  ``none``       no rank (the other probes still run everywhere)
  ``0,3,8-15``   these ranks
  ``per-node``   one rank per host: local rank 0
  ``per-coord``  one rank per coordinate of each mesh dimension: the ranks whose mesh coordinate
                 differs from rank 0's in at most one dimension (the "star" through coordinate
                 0), so that every pp stage, tp shard and dp index is covered, each line forming
                 a whole group (one complete pipeline, one complete tp group, ...):
                 dp4 x pp2 x tp2 -> 4 + 2 + 2 - 2 = 6 ranks. Without a DeviceMesh covering the
                 world: per-node plus rank 0.
  ``auto``       (default) ``all`` up to AUTO_ALL_MAX ranks; above, ``per-coord`` when it selects
                 at most AUTO_ALL_MAX ranks, else ``per-node`` plus rank 0.

Standard library only: the probes import it inside the training processes.
"""

from __future__ import annotations

# the spec's grammar is core (wrap and the settings reader validate it too)
from trainprof.rankranges import (AUTO_ALL_MAX, ENV, KEYWORDS, MAX_RANK, RankList,  # noqa: F401
                                  canonical, parse)


def _mesh_usable(mesh: dict | None, world_size: int) -> bool:
    if not mesh:
        return False
    shape, coord = mesh.get("shape") or [], mesh.get("coord")
    n = 1
    for s in shape:
        n *= int(s)
    return bool(shape) and n == world_size and coord is not None and len(coord) == len(shape)


def star_size(shape) -> int:
    """How many ranks per-coord selects on a mesh of this shape."""
    return sum(int(s) for s in shape) - (len(shape) - 1) if shape else 0


def decide(spec, rank: int, world_size: int, local_rank: int | None,
           mesh: dict | None) -> tuple[bool, str]:
    """(does this rank record a trace, the policy that decided). ``spec``: what parse() returns
    (or a string for it); ``mesh``: {"shape": [...], "coord": [...]} of the job's DeviceMesh as
    seen by this rank, or None. The policy is the keyword given, ``list``, or for ``auto`` the
    one it resolved to (``all``, ``per-coord``, ``per-node``)."""
    p = parse(spec) if spec is None or isinstance(spec, str) else spec
    if isinstance(p, RankList):
        return rank in p, "list"
    if p == "auto":
        if world_size <= AUTO_ALL_MAX:
            p = "all"
        elif _mesh_usable(mesh, world_size) and star_size(mesh["shape"]) <= AUTO_ALL_MAX:
            p = "per-coord"
        else:
            p = "per-node"
    if p == "all":
        return True, p
    if p == "none":
        return False, p
    if p == "per-coord" and _mesh_usable(mesh, world_size):
        return sum(1 for c in mesh["coord"] if int(c) != 0) <= 1, p
    # per-node (also per-coord without a mesh covering the world): local rank 0, and rank 0
    return rank == 0 or local_rank == 0, "per-node"


def select(spec, world_size: int, local_rank_of=None, mesh_shape=None) -> tuple[list[int], str]:
    """The ranks a job of ``world_size`` ranks profiles, every rank deciding as decide() does:
    with a row-major DeviceMesh of ``mesh_shape`` (init_device_mesh's layout) and local ranks
    ``local_rank_of(rank)`` (default: none known). For tests and for explaining a choice."""
    chosen, policy = [], "none"
    for r in range(world_size):
        mesh = None
        if mesh_shape:
            coord, rest = [], r
            for s in reversed(mesh_shape):
                coord.append(rest % s)
                rest //= s
            mesh = {"shape": list(mesh_shape), "coord": coord[::-1]}
        ok, policy = decide(spec, r, world_size, local_rank_of(r) if local_rank_of else None, mesh)
        if ok:
            chosen.append(r)
    return chosen, policy
