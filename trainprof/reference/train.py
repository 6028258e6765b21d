"""The training loop of the reference workload."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from trainprof.reference import faults as faultlib
from trainprof.reference.config import Config, parse_args
from trainprof.reference.data import loader
from trainprof.reference.model import build_full, extract_stage, loss_fn, param_counts
from trainprof.reference.parallel import (TP_PLAN, allreduce_grads, apply_fsdp, apply_tp,
                                          layer_layout, make_mesh, stage_ids)
from trainprof.rundir.files import INJECTED, write_json_atomic


def _init_distributed(cfg: Config) -> tuple[torch.device, str]:
    if "RANK" not in os.environ:  # plain `python -m trainprof.reference`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        local, n_dev = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        backend = "nccl" if cfg.backend == "auto" else cfg.backend
        if n_dev and local >= n_dev and backend == "nccl":
            _usage_error(f"local rank {local} but {n_dev} GPU(s): NCCL runs one rank per GPU "
                         "(--backend gloo lets ranks share a GPU)")
        local = local % max(n_dev, 1)  # gloo: ranks share the GPUs
        torch.cuda.set_device(local)
        torch.cuda.init()  # DeviceMesh then keeps this device (it sets LOCAL_RANK's otherwise)
        device = torch.device("cuda", local)
    else:
        if cfg.backend == "nccl":
            _usage_error("--backend nccl needs CUDA (--device cuda)")
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return device, backend


def _usage_error(msg: str):
    """Bad --inject specs fail like argparse's usage errors: a message and exit status 2."""
    print(f"python -m trainprof.reference: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _free_port() -> int:
    """A port no one listens on now, so that several single-process runs can coexist."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_injected(faults, layout, world, cfg, coords_of) -> None:
    run_dir = os.environ.get("TRAINPROF_RUN_DIR")
    if not run_dir:
        return

    entries = []
    for f in faults:
        d = f.to_dict()
        if "rank" in f.params:
            d["coords"] = coords_of(f.params["rank"])
        if f.kind == "fragment" and f.performed:
            d["hole_bytes"] = faultlib.FRAG_SEGMENTS * 2 * faultlib.FRAG_HOLE
            d["kept_bytes"] = faultlib.FRAG_SEGMENTS * 2 * faultlib.FRAG_KEEP
        if f.kind == "imbalance":
            k = f.params["stage"]
            d["ranks"] = [r for r in range(world) if coords_of(r)["pp"] == k % cfg.pp]
            d["layers_per_stage"] = [len(x) for x in layout]
        entries.append(d)
    write_json_atomic(os.path.join(run_dir, INJECTED),
                      {"schema_version": 1, "injections": entries,
                       "layout": {"dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp}})


def main(argv=None, on_step=None) -> int:
    """on_step(step): called at the top of every step (benchmarks/bench_probes_ab.py toggles the
    probes there)."""
    cfg = parse_args(argv)
    try:
        fault_list = [faultlib.parse(s) for s in cfg.inject]
    except faultlib.FaultSpecError as e:
        _usage_error(str(e))
    device, backend = _init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.dp * cfg.pp * cfg.tp:
        raise SystemExit(f"reference: world size {world} != dp*pp*tp = {cfg.dp * cfg.pp * cfg.tp}")
    faultlib.check_cpu_only(fault_list, device)
    try:
        injector = faultlib.Injector(fault_list, rank, world)
    except faultlib.FaultSpecError as e:
        _usage_error(str(e))

    mesh = make_mesh(device.type, cfg.dp, cfg.pp, cfg.tp)
    dp_rank, pp_rank, tp_rank = (mesh.get_local_rank(d) for d in ("dp", "pp", "tp"))

    def coords_of(r: int) -> dict:  # init_device_mesh lays ranks out row-major over (dp, pp, tp)
        return {"dp": r // (cfg.pp * cfg.tp), "pp": (r // cfg.tp) % cfg.pp, "tp": r % cfg.tp}

    assert coords_of(rank) == {"dp": dp_rank, "pp": pp_rank, "tp": tp_rank}, "unexpected mesh layout"

    st = _build_stages(cfg, device, mesh, fault_list, injector, world, coords_of, pp_rank)
    layout, my_stages, modules = st.layout, st.my_stages, st.modules
    if rank == 0:
        _write_injected(fault_list, layout, world, cfg, coords_of)
        if cfg.loss_file:
            open(cfg.loss_file, "w").close()  # one run per loss file
    import trainprof

    trainprof.set_run_info(
        model="trainprof.reference", tokens_per_step=cfg.global_batch * cfg.seq_len,
        n_params=st.n_params, n_params_non_embedding=st.n_params_ne, layers=st.n_layers, hidden=cfg.hidden,
        heads=cfg.heads, seq_len=cfg.seq_len, vocab=cfg.vocab, micro_batches=cfg.micro_batches,
        global_batch=cfg.global_batch, schedule=cfg.schedule if cfg.pp > 1 else None,
        dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, virtual_stages=cfg.virtual_stages, dtype=cfg.dtype,
        dp_mode=cfg.dp_mode, activation_checkpointing=False, optimizer="adamw",
        stage_layers=[len(x) for x in layout], stage_layer_ids=layout, my_stages=my_stages,
        stage_params=st.stage_params,
        param_dtype="fp32", tp_plan="attn.q/k/v,mlp.up colwise; attn.o,mlp.down rowwise")

    _train(cfg, modules, my_stages, st.n_stages, mesh, device, dp_rank, injector, st.step_ref,
           on_step, rank, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


@dataclasses.dataclass
class _Stages:
    """This rank's pipeline stages, built and parallelized, and the model facts run_info records."""
    layout: list
    my_stages: list
    n_stages: int
    modules: list
    step_ref: list
    stage_params: list
    n_params: int
    n_params_ne: int
    n_layers: int


def _build_stages(cfg, device, mesh, fault_list, injector, world, coords_of, pp_rank) -> _Stages:
    """The full model built once (seeded), cut into pipeline stages (an injected imbalance adds
    layers to its stage), this rank's stages kept and parallelized (TP, FSDP), NaN faults hooked."""
    n_stages = cfg.pp * cfg.virtual_stages
    extra = {}
    for f in fault_list:
        if f.kind == "imbalance":
            if not 0 <= f.params["stage"] < n_stages:
                _usage_error(f"--inject imbalance: stage {f.params['stage']} outside 0..{n_stages - 1}")
            extra[f.params["stage"]] = extra.get(f.params["stage"], 0) + f.params["extra_layers"]
    layout = layer_layout(cfg.layers, n_stages, extra)
    n_layers = sum(len(x) for x in layout)
    full = build_full(cfg, n_layers)
    n_params, n_params_ne = param_counts(full)
    try:
        faultlib.validate(fault_list, full, layout, cfg.pp, cfg.steps, world, coords_of)
    except faultlib.FaultSpecError as e:
        _usage_error(str(e))
    stage_params = _stage_params(full, layout, n_stages)
    autocast = torch.bfloat16 if (cfg.dtype == "bf16" and device.type == "cuda") else None

    my_stages = stage_ids(pp_rank, cfg.pp, cfg.virtual_stages)
    modules = []
    for s in my_stages:
        m = extract_stage(full, layout[s], first=s == 0, last=s == n_stages - 1, autocast_dtype=autocast)
        modules.append(m)
    del full
    stage_named = {}
    for m in modules:
        stage_named.update(dict(m.named_modules()))
    for m in modules:
        m.to(device)
        if cfg.tp > 1:
            apply_tp(m, mesh["tp"])
        if cfg.dp > 1 and cfg.dp_mode == "fsdp":
            apply_fsdp(m, mesh["dp"])
    step_ref = [0]
    injector.install_nan_hooks(stage_named, step_ref)  # validated above: the module is here
    return _Stages(layout, my_stages, n_stages, modules, step_ref, stage_params, n_params, n_params_ne,
                   n_layers)



def _train(cfg, modules, my_stages, n_stages, mesh, device, dp_rank, injector, step_ref, on_step,
           rank, world) -> None:
    """The training loop: cfg.steps optimizer steps, each ending with two world-group
    collectives (the loss, then per-rank stats) that rank 0 prints."""
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    is_first = 0 in my_stages
    is_last = (n_stages - 1) in my_stages
    schedule = _make_schedule(cfg, modules, my_stages, n_stages, mesh, device) if cfg.pp > 1 else None
    data = iter(loader(cfg, dp_rank, injector.data_delay_s()))
    world_group = dist.group.WORLD

    for step in range(cfg.steps):
        if on_step is not None:
            on_step(step)
        step_ref[0] = step
        t0 = time.perf_counter()
        injector.straggle(step, device)
        injector.fragment(step, device)
        x, y = next(data)
        x, y = x.to(device), y.to(device)
        local_loss = torch.zeros((), device=device)
        if schedule is None:
            for xm, ym in zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches)):
                loss = loss_fn(modules[0](xm), ym)
                (loss / cfg.micro_batches).backward()
                local_loss += loss.detach() / cfg.micro_batches
        else:
            losses: list = []
            args = (x,) if is_first else ()
            schedule.step(*args, target=y if is_last else None, losses=losses if is_last else None)
            if is_last and losses:
                local_loss = torch.stack([l.detach().float() for l in losses]).mean()
        if cfg.dp > 1 and cfg.dp_mode == "replicate":
            allreduce_grads(params, mesh["dp"].get_group(), cfg.dp)
        opt.step()
        opt.zero_grad(set_to_none=True)

        # Two world-group collectives end every step: the loss, then per-rank stats.
        mode = injector.hang_mode(step)
        if mode == "sleep":
            _injected_hang_sleep()
        total = local_loss.detach().clone() if is_last else torch.zeros((), device=device)
        if mode != "skip":
            dist.all_reduce(total, group=world_group)
        ms = (time.perf_counter() - t0) * 1e3
        stats = torch.tensor([ms, float(rank)], device=device)
        gathered = torch.empty(2 * world, device=device)
        dist.all_gather_into_tensor(gathered, stats, group=world_group)
        loss_value = float(total) / (cfg.dp * cfg.tp)
        if rank == 0:
            slowest = float(gathered.view(world, 2)[:, 0].max())
            print(f"step {step:4d}  loss {loss_value:.4f}  {ms:7.1f} ms (slowest rank {slowest:.1f} ms)",
                  flush=True)
            if cfg.loss_file:
                with open(cfg.loss_file, "a") as fh:
                    fh.write(json.dumps({"step": step, "loss": loss_value}) + "\n")


def _stage_params(full, layout, n_stages) -> list[dict]:
    """Per pipeline stage: parameter count and how many of them tensor parallel shards (the
    memory analyzer's expected bytes per rank come from this and the mesh)."""
    out = []
    for s, ids in enumerate(layout):
        total = sharded = 0
        for name, p in full.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                if int(parts[1]) not in ids:
                    continue
                if ".".join(parts[2:4]) in TP_PLAN:
                    sharded += p.numel()
            elif not ((parts[0] == "tok_emb" and s == 0) or (parts[0] in ("norm", "head") and s == n_stages - 1)):
                continue
            total += p.numel()
        out.append({"stage": s, "params": total, "tp_sharded_params": sharded})
    return out


def _injected_hang_sleep() -> None:
    """hang:mode=sleep — this rank blocks here, before its next collective."""
    time.sleep(24 * 3600)


def _make_schedule(cfg, modules, my_stages, n_stages, mesh, device):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    group = mesh["pp"].get_group()
    stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, my_stages)]
    if cfg.schedule == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, cfg.micro_batches, loss_fn=loss_fn)
    cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], cfg.micro_batches, loss_fn=loss_fn)
