"""The job's parallel layout as reports name it: the mesh sizes of the header and each rank's
coordinates when the job built no DeviceMesh.

A DeviceMesh dimension with a data/pipeline/tensor-parallel name (probes/rankinfo.py
MESH_ALIASES) counts toward dp/pp/tp; any other dimension — an unnamed mesh's ``dim0``, ``cp``,
``ep`` — keeps its own name and real size (``dim0=2``), never folded into dp. Without a
DeviceMesh (plain DDP) the layout comes from the process groups the probes labelled
(groups.jsonl ``mesh_dim``: DDP's group is ``dp``): a rank's coordinate is its index in that group.
"""

from __future__ import annotations

CANONICAL = ("dp", "pp", "tp")
# DeviceMesh dimension names that mean a canonical axis
MESH_ALIASES = {
    "dp": ("dp", "data", "data_parallel", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp",
           "dp_shard_cp", "replicate", "shard"),
    "pp": ("pp", "pipe", "pipeline", "pipeline_parallel"),
    "tp": ("tp", "tensor", "tensor_parallel", "model", "mp"),
}


def canonical_dim(name) -> str | None:
    n = str(name).lower()
    return next((c for c, aliases in MESH_ALIASES.items() if n in aliases), None)


def mesh_sizes(mesh: dict | None) -> dict:
    """{"dp": 2, "pp": 1, "tp": 2} from meta.json's mesh {dim_names, shape}: dims meaning one
    axis multiply; the canonical axes are listed when the mesh names at least one of them;
    other dims follow by name ({"dim0": 2} for an unnamed 1-D mesh). {} without a mesh."""
    if not isinstance(mesh, dict):
        return {}
    canon: dict[str, int] = {}
    other: dict[str, int] = {}
    for n, s in zip(mesh.get("dim_names") or [], mesh.get("shape") or []):
        try:
            s = int(s)
        except (TypeError, ValueError):
            continue
        c = canonical_dim(n)
        if c:
            canon[c] = canon.get(c, 1) * s
        else:
            other[str(n)] = s
    out = {k: canon.get(k, 1) for k in CANONICAL} if canon else {}
    out.update(other)
    return out


def _labelled_groups(records) -> list[tuple[str, list[int]]]:
    out = []
    for g in records or ():
        if not isinstance(g, dict):
            continue
        dim, ranks = g.get("mesh_dim"), g.get("ranks")
        if (dim in CANONICAL and isinstance(ranks, list) and len(ranks) > 1
                and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
            out.append((dim, ranks))
    return out


def group_coords(records, rank: int) -> dict:
    """A rank's coordinates from its labelled process groups (groups.jsonl records): {"dp": i}
    where the rank is the i-th member of its dp group; {} when no group is labelled."""
    out: dict[str, int] = {}
    for dim, ranks in _labelled_groups(records):
        if dim not in out and rank in ranks:
            out[dim] = ranks.index(rank)
    return out


def group_sizes(records, world_size: int | None) -> dict:
    """{"dp": 2, "pp": 1, "tp": 1} from labelled process groups when their sizes multiply to
    the world size (the whole layout is known); {} otherwise."""
    sizes: dict[str, int] = {}
    for dim, ranks in _labelled_groups(records):
        sizes.setdefault(dim, len(ranks))
    total = 1
    for s in sizes.values():
        total *= s
    if not sizes or not world_size or total != world_size:
        return {}
    return {k: sizes.get(k, 1) for k in CANONICAL}

