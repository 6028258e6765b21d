"""Where the NaN watch locates a detection and how the ranks of a replay agree through the store (a
part of probes/nan_watch.py's NanWatch)."""

from __future__ import annotations

import math
import time
import zlib

from trainprof.probes.nan_values import value_kind_of


class PeerAgreement:
    """Where the NaN watch locates a detection and how the ranks of a replay agree through the
    store; mixed into NanWatch."""

    def _locate(self, where):
        """First detection on this rank: replay the step's root calls with module- and op-level
        checks (nan_locate), before the optimizer changes the parameters."""
        from trainprof.probes import nan_locate  # lazy: start-up time of the job's ranks

        self.located = True
        first = self.resolver.first or {}
        loss_bad = any(not math.isfinite(float(x)) for x in self.losses)
        grads_bad = self.grad_info is not None and not math.isfinite(float(self.grad_info[0]))
        t0 = time.perf_counter()
        t0_ns = time.time_ns()
        self._off += 1
        self.s.state["nan_replay"] = True  # the collective log marks what the replay issues
        try:
            bad = nan_locate.nonfinite_parameters(self.roots, self._param_name)
            peers = sorted({r for c in self.roots for r in (c.peers or ())})
            agreed = note = None
            if peers:  # every peer must replay the same calls, or its collectives would hang
                ready = not bad and all(nan_locate.inputs_unchanged(c) for c in self.roots)
                agreed, note = self._agree(peers, ready)
            if bad:  # the forward read a parameter that was already non-finite: a replay would
                res = self._parameter_verdict(bad)  # convict the first module that uses it
            elif peers and not agreed:
                res = {"created": False, "notes": [note]}
            else:
                res = nan_locate.locate_step(self.roots, self._names.get, loss_bad, grads_bad,
                                             coordinated=bool(peers))
                if peers:
                    res["replayed_with"] = peers
        except Exception as e:  # noqa: BLE001
            res = {"notes": [f"locate failed: {type(e).__name__}: {e}"]}
        finally:
            self._off -= 1
            self.s.state["nan_replay"] = False
            self._book_replay(t0_ns)  # NanWatch: probe overhead and an overhead span
        rec = {"kind": "origin", "step": self.resolver.step, "t_ns": first.get("t_ns"),
               "detected_by": first.get("role"), "at": where, "root_calls": len(self.roots),
               "loss_nonfinite": loss_bad, "grads_nonfinite": grads_bad}
        rec.update(res)
        rec["replay_ms"] = (time.perf_counter() - t0) * 1e3
        self._write(rec)

    def _agree(self, peers: list, ready: bool) -> tuple:
        """Through the job's TCPStore (no collective, so a peer that never detects costs one
        bounded wait, not a hang): this rank publishes its readiness and root-call count for this
        step and waits up to TRAINPROF_NAN_PEER_WAIT_S for its mesh peers' (tensor parallel,
        FSDP2). Keys are per peer group: the stages of a pipeline agree separately."""
        import json
        from datetime import timedelta

        import torch.distributed as dist

        step, me = self.resolver.step, self.s.rank
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception as e:  # noqa: BLE001
            return False, f"coordinated replay skipped: no store ({type(e).__name__}: {e})"
        group = ",".join(map(str, peers))
        prefix = f"trainprof/nan_replay/{step}/{peers[0]}-{zlib.crc32(group.encode()):08x}/"
        store.set(prefix + str(me), json.dumps({"calls": len(self.roots), "ready": bool(ready)}))
        others = [p for p in peers if p != me]
        try:
            store.wait([prefix + str(p) for p in others], timedelta(seconds=self.peer_wait_s))
        except Exception:  # noqa: BLE001 - timeout: some peer did not detect at this step
            missing = [p for p in others if not store.check([prefix + str(p)])]
            return self._decide(store, prefix, "abort",
                                f"coordinated replay skipped: mesh peers {missing} did not "
                                f"detect at step {step} within {self.peer_wait_s:g} s")
        info = {p: json.loads(store.get(prefix + str(p))) for p in others}
        odd = [p for p, i in info.items() if not i.get("ready") or i.get("calls") != len(self.roots)]
        note = None
        if not ready or odd:
            note = (f"coordinated replay skipped: ranks {sorted(odd + ([me] if not ready else []))} "
                    f"not ready (inputs changed, stale parameters, or other root calls)")
        return self._decide(store, prefix, "abort" if note else "go", note)

    def _decide(self, store, prefix, mine: str, note):
        """Every rank proposes; the first proposal stored wins and every rank follows it (a rank
        whose wait timed out proposes abort, so a late peer cannot replay alone)."""
        try:
            got = store.compare_set(prefix + "decision", "", mine)
            got = got.decode() if isinstance(got, bytes) else str(got)
        except Exception as e:  # noqa: BLE001
            return False, f"coordinated replay skipped: store decision failed ({type(e).__name__}: {e})"
        if got == "go":
            return True, None
        return False, note or "coordinated replay skipped: a peer's wait for the others timed out"

    def _parameter_verdict(self, bad: list) -> dict:
        """Parameters were non-finite before this step's forward: written so by an optimizer step
        (or code updating them) after the last step whose parameter check was finite."""
        step, ok = self.resolver.step, self._params_ok_step
        lo = ok + 1 if ok is not None else 0
        if lo > step - 1:  # finite after the previous optimizer step: changed within this step
            window = [step, step]
            when = f"code that changed it during step {step}, before its forward (not an optimizer step)"
        else:
            window = [lo, step - 1]
            when = (f"the optimizer step of step {lo}" if lo == step - 1 else
                    f"an optimizer step between steps {lo} and {step - 1}")
        last = (f" (parameters were last checked finite at step {ok})" if ok is not None else
                " (never checked finite before: possibly loaded or initialized so)")
        first = bad[0]
        return {"created": True, "phase": "optimizer", "role": "parameters", "module": first["module"],
                "op": None, "param": first["param"], "origin_steps": window, "value": value_kind_of(first),
                "params_nonfinite": [b["param"] for b in bad[:20]], "first_params": bad[:5],
                "evidence": f"parameter {first['param']} was already {value_kind_of(first)} when step "
                            f"{step}'s forward read it: written by {when}{last}, not by this "
                            f"step's computation"}

    def _maybe_locate(self, where):
        first = self.resolver.first
        if (self.replay_on and not self.located and first is not None
                and first.get("role") in ("loss", "parameter_grads")):
            self._locate(where)
