"""The module and tensor hooks of the NaN watch: per-call finiteness stats, root module calls kept
for a replay, the global hooks' discovery of roots (a part of probes/nan_watch.py's NanWatch)."""

from __future__ import annotations

import functools
import math
import time
import weakref

from trainprof.probes.nan_values import (MAX_ROOT_CALLS, _Call, _is_floating, _NoHandle, _Root,
                                          clean_path, tensors_in)


# torch.compile(module) warns on every OptimizedModule call while any global module hook is
# registered ("... hooks fire an extra time ..."): while ours are, that warning is about trainprof,
# not the job, and is filtered by its text; the filter goes when our global hooks go
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
_compile_filter = None


def _remove_global_hooks(handles) -> None:
    """Remove hook handles; a global forward hook registered with_kwargs also leaves its id in
    torch's _global_forward_hooks_with_kwargs (RemovableHandle does not clear it), which keeps
    torch.nn's "any global hook?" true for the rest of the job: cleared here too."""
    try:
        from torch.nn.modules import module as nnm

        leftover = getattr(nnm, "_global_forward_hooks_with_kwargs", None)
    except Exception:  # noqa: BLE001
        leftover = None
    for h in handles:
        h.remove()
        if leftover is not None and getattr(h, "id", None) in leftover \
                and h.id not in getattr(nnm, "_global_forward_hooks", {}):
            leftover.pop(h.id, None)


def _quiet_compile_warning(on: bool) -> None:
    global _compile_filter
    import warnings

    try:
        if on and _compile_filter is None:
            warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
            _compile_filter = warnings.filters[0]
        elif not on and _compile_filter is not None:
            f, _compile_filter = _compile_filter, None
            if f in warnings.filters:
                warnings.filters.remove(f)
                mutated = getattr(warnings, "_filters_mutated", None)
                if mutated is not None:
                    mutated()
    except Exception:  # noqa: BLE001 - a warning shown is no reason to disturb the job
        pass


class ModuleHooks:
    """The module and tensor hooks of the NaN watch: per-call finiteness stats, root module calls
    kept for a replay, the global hooks' discovery of roots; mixed into NanWatch."""

    def _name(self, mod) -> str:
        n = self._names.get(mod)
        if n is None:
            root_cls = type(mod).__name__
            ddp = root_cls == "DistributedDataParallel"
            for path, m in mod.named_modules():
                if ddp and path.startswith("module."):
                    path = path[len("module."):]
                if m not in self._names:
                    self._names[m] = clean_path(path) if path else f"<{type(m).__name__}>"
            for path, p in mod.named_parameters():
                if ddp and path.startswith("module."):
                    path = path[len("module."):]
                self._pnames.setdefault(id(p), (weakref.ref(p), clean_path(path)))
            n = self._names[mod]
        return n

    def _param_name(self, p) -> str | None:
        ent = self._pnames.get(id(p))
        return ent[1] if ent and ent[0]() is p else None

    def _stat(self, t):
        """max |x| of a tensor (NaN if any NaN): a host float on CPU, a 0-dim device tensor on
        CUDA. Cached per (tensor, version): one module's output is the next one's input."""
        lt = getattr(t, "_local_tensor", None)
        if lt is not None:
            t = lt
        key = id(t)
        c = self._cache.get(key)
        if c is not None and c[0]() is t and c[1] == t._version:
            return c[2]
        if t.numel() == 0:
            return None
        d = t.detach()
        if d.device.type == "cpu":
            # aminmax is one vectorized pass on CPU (vector_norm(inf) is a scalar loop, 5-10x slower)
            mn, mx = self.torch.aminmax(d)
            mn, mx = float(mn), float(mx)
            v = mx if mx != mx else max(mx, -mn)  # NaN propagates through both
        else:
            v = self.torch.linalg.vector_norm(d, math.inf)  # one kernel, no overflow
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = (weakref.ref(t), t._version, v)
        return v

    def _floats(self, x, acc):
        return tensors_in(x, acc, self.torch.Tensor, _is_floating)

    def _emit(self, kind, call, vals, tensors=None):
        """Feed the resolver now (host values) or queue for the boundary (device values)."""
        flat = vals if kind != "fwd" else vals[0] + vals[1]
        if any(v is not None and not isinstance(v, float) for v in flat):
            self.events.append((kind, call, vals, time.time_ns()))
        else:
            self.resolver.feed(kind, call, vals, tensors, time.time_ns())

    def _pre(self, mod, args):
        if mod not in self._hooked and not self._off:
            try:
                self._name(mod)
                if self.modules_mode == "leaf" and next(mod.children(), None) is not None:
                    self._hooked[mod] = _NoHandle  # containers unwatched: fewer hooks per step
                    return
                self._hooked[mod] = mod.register_forward_hook(self._post, with_kwargs=True)
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def _post(self, mod, args, kwargs, out):
        if self._off:
            return None
        try:
            outs = self._floats(out, [])
            if not outs:
                return None
            ins = self._floats(args, [])
            if kwargs:
                self._floats(kwargs, ins)
            call = _Call(self._names.get(mod) or self._name(mod), mod)
            in_v = [self._stat(t) for t in ins]
            out_v = [self._stat(t) for t in outs]
            self.calls += 1
            immediate = isinstance(out_v[0], float) or out_v[0] is None
            if immediate and self.detected_step is None:
                call.args, call.kwargs = args, kwargs  # refs; cloned only if a candidate
            if self.torch.is_grad_enabled() and any(t.requires_grad for t in outs):
                if immediate and self.detected_step is None:
                    call.versions = [t._version for t in ins]
                for i, t in enumerate(outs):
                    if t.requires_grad:
                        self._tensor_hook(t).append(("gout", call, i, immediate))
                for t in ins:
                    if t.requires_grad:
                        self._tensor_hook(t).append(("gin", call, None, None))
            self._emit("fwd", call, (in_v, out_v), (ins, outs))
            if call.versions is None:
                call.args = call.kwargs = None  # no backward will need them
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    def _tensor_hook(self, t) -> list:
        """One gradient hook per tensor. A tensor that is module A's output and module B's
        input gets one gradient: B's input-gradient is judged first (B's backward produced it),
        then A's output-gradient (A merely receives it)."""
        slot = t.__dict__.get("_trainprof_nan")
        if slot is None or slot[2] is not self.slots:
            # new tensor, or one reused from an earlier step (pipelining's recv buffers: a
            # leaf keeps its hooks across backward passes)
            slot = t.__dict__["_trainprof_nan"] = [[], None, self.slots]
            self.slots.append(slot)
        else:
            # Move our hook behind hooks registered since (e.g. by B's forward pre-hooks):
            # B's input-gradient is what B's backward receives after all of them.
            slot[1].remove()
        slot[1] = t.register_hook(functools.partial(self._grad_hook, slot[0]))
        return slot[0]

    def _grad_hook(self, entries, g):
        if self._off or g is None:
            return None
        try:
            v = self._stat(g)
            for kind, call, i, keep in sorted(entries, key=lambda e: e[0] != "gin"):
                if kind == "gin":
                    self._emit("gin", call, [v], [g])
                    call.gouts = {}  # this call's backward is over: drop the references
                else:
                    if keep and self.detected_step is None:
                        call.gouts[i] = g
                    self._emit("gout", call, [v], [g])
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    def _discover(self, on):
        from torch.nn.modules import module as nnm

        if on and not self._discover_handles:
            self._depth = 0
            self._discover_handles = [
                nnm.register_module_forward_pre_hook(self._g_pre),
                nnm.register_module_forward_hook(self._g_post, always_call=True, with_kwargs=True)]
            _quiet_compile_warning(True)
        elif not on:
            _remove_global_hooks(self._discover_handles)
            self._discover_handles = []
            if not self.modules_on:
                _quiet_compile_warning(False)

    def _g_pre(self, mod, args):
        self._depth += 1
        if self._depth == 1:
            self._root_start(mod, args, None)

    def _g_post(self, mod, args, kwargs, out):
        self._depth -= 1
        if self._depth == 0:
            if self.roots and self.roots[-1].module is mod and self.roots[-1].kwargs is None and kwargs:
                self.roots[-1].kwargs = kwargs
            self._root_end(mod, out)

    def _install_roots(self):
        """Per-root hooks replace the global ones: module calls inside the roots pay nothing."""
        for m in list(self.roots_known):
            if m in self._root_hooked:
                continue
            self._root_hooked.add(m)
            self._root_handles.append(m.register_forward_pre_hook(self._r_pre, with_kwargs=True, prepend=True))
            self._root_handles.append(m.register_forward_hook(self._r_post, always_call=True))
        self._discover(False)
        self._depth = 0

    def _r_pre(self, mod, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            self._root_start(mod, args, kwargs)

    def _r_post(self, mod, args, out):
        self._depth -= 1
        if self._depth == 0:
            self._root_end(mod, out)

    def _refusal(self, mod) -> tuple:
        """(why a replay is impossible, or None; the ranks a replay must run with, or None).
        Modules whose parameters are DTensors on one device mesh — tensor parallel, FSDP2
        (fully_shard), or both on a 2-D mesh — replay together with every rank of that mesh
        (nan_locate: coordinated replay); FSDP1's flat parameters are refused."""
        m = mod.module if type(mod).__name__ == "DistributedDataParallel" else mod
        for x in m.modules():
            if type(x).__name__ == "FullyShardedDataParallel":
                return "FSDP1-managed (flat parameters): a replay would all-gather into the job's state", None
        meshes = {}
        for t in list(m.parameters()) + list(m.buffers()):
            mesh = getattr(t, "device_mesh", None)
            if mesh is None and hasattr(t, "_local_tensor"):
                return "DTensor parameters without a device mesh", None
            if mesh is not None:
                meshes[id(mesh)] = mesh
        if not meshes:  # (a one-rank replay still refuses FSDP state: nan_locate._refuse_distributed)
            return None, None
        # FSDP2 over TP: the sharded TP weights live on the 2-D (dp, tp) mesh, the others on
        # their 1-D dp sub-mesh; every collective of a replay stays within the union
        ranks = sorted({int(r) for x in meshes.values() for r in x.mesh.flatten().tolist()})
        return None, ranks if len(ranks) > 1 else None

    def _root_start(self, mod, args, kwargs):
        if self._off:
            return
        try:
            torch = self.torch
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # eval / no_grad calls, and checkpoint recomputation inside the backward
            ent = self._replayable.get(id(mod))
            if ent is None or ent[0]() is not mod:
                why, peers = self._refusal(mod)
                ent = self._replayable[id(mod)] = (weakref.ref(mod), why, peers)
                self._name(mod)
                self.roots_known.add(mod)
                self._write({"kind": "root", "step": self.s.clock.step, "module": self._names.get(mod),
                             "module_class": type(mod).__name__, "replayable": why is None, "reason": why,
                             "replay_with": peers})
            why, peers = ent[1], ent[2]
            if why is not None or len(self.roots) >= MAX_ROOT_CALLS:
                return
            T = torch.Tensor
            if not kwargs and all(type(a) is T for a in args):  # the common case: no walk
                ts = list(args)
            else:
                ts = self._tensors(args, [])
                if kwargs:
                    self._tensors(kwargs, ts)
            cuda = ts[0].is_cuda if len(ts) == 1 else any(t.is_cuda for t in ts)
            if cuda and not self.sync:
                return  # the detection arrives steps later on CUDA: nothing to replay with
            self.roots.append(_Root(mod, args, kwargs, [t._version for t in ts], torch.get_rng_state(),
                                    torch.cuda.get_rng_state() if cuda else None, peers))
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _root_end(self, mod, out):
        c = self.roots[-1] if self.roots else None
        if c is None or c.module is not mod or c.outs or self._off:
            return
        try:
            if not self.torch.is_grad_enabled():
                return
            for i, t in enumerate(self._floats(out, [])):
                c.outs.append(weakref.ref(t))
                if t.requires_grad and self.kept_bytes + 2 * t.numel() * t.element_size() <= self.keep_bytes:
                    # autograd stores the gradient on the output (a C++ hook, ~3 µs; a Python grad
                    # hook costs 20-40 µs per call, and measured +1.5 % more on the toy reference).
                    # The output is held only until the next backward call or the optimizer step,
                    # which take the gradient (_harvest); the cap counts it with its gradient.
                    t.retain_grad()
                    c.held.append((i, t))
                    self.kept_bytes += 2 * t.numel() * t.element_size()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _harvest(self, final=False):
        """Move the gradients w.r.t. root outputs out of the held outputs, then drop those."""
        for c in self.roots:
            if not c.held:
                continue
            keep = []
            for i, t in c.held:
                g = t.grad
                if g is None:
                    if not final:
                        keep.append((i, t))  # its backward has not run yet
                    continue
                c.grads[i] = g  # counted in kept_bytes when held; autograd does not modify it
            c.held = keep

    def _tensors(self, x, acc):
        return tensors_in(x, acc, self.torch.Tensor)
