"""The length axis of issue 30 on one GPU (perf/gpu/gpu_train.sh length), one process per rank
(``python3 -m scape.launch -n 4 perf/gpu/gpu_length.py --lengths 0.1,0.2,0.4 ...``).

perf/train/scaling.py's length axis (the gap of SCAPE to dense AdamS against training tokens
per parameter, the same tokens per step at every point, each length its own lr schedule
ending at its length) at perf/gpu/gpu_train.py's GPU model instead of the CPU's 0.12M: every
run is gpu_train.py's training (imported, not copied), and all of them run one after the
other in this one launch, on one communicator, so that start-up is paid once.

Order: the lengths from the shortest, at each length the methods in the order given (dense
AdamS first: it is the reference of the gap, and the slowest step, so the first estimate is
not optimistic). The time: the runs must end by --end-epoch. After --probe-steps steps of the
first run (half its steps if fewer), the step time measured so far (the slowest rank's, the
first two steps left out) plans every length in 85% of the time left (PLAN_SHARE), less a
reserve for the deadline rule of the last run (RESERVE_S); before each later length the plan
is redone with what the finished runs measured. A length whose runs do not fit is shrunk to
the length that fits when at least half of it does (and it stays longer than the length
before it), and skipped otherwise; every later length is then skipped. The first length is
shrunk to whatever fits (at least --min-steps steps): the first run then starts again at that
length. Each decision is printed and kept in OUT/length_plan.json. Every run also has its own
deadline (1.5x its estimate plus 20 s; 3x plus 30 s for a method not measured yet; never past
--end-epoch), past which it stops at an evaluation and is marked truncated.

Rank 0 appends one JSON line per finished run to OUT/length_runs.jsonl (gpu_train.py's record
plus the requested and actual tokens per parameter); perf/gpu/gpu_length_report.py makes the
table. --self-test checks the planner alone (no ranks, no training).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_common as gc  # noqa: E402
import gpu_train  # noqa: E402

DENSE = "adams"
# the share of the time left that the plan fills: the rest absorbs the estimates' error (steps
# measured on a few steps, a machine shared with other work)
PLAN_SHARE = 0.85
# ... of the time left less this and two evaluations: a run stops early (truncated) when the
# next evaluation period, two evaluations and 5 s would pass its deadline (gpu_train.py), so
# the last run before the end needs that much beyond its own estimate
RESERVE_S = 6.0


def steps_for(tpp: float, n_params: int, tokens_per_step: int) -> int:
    return max(1, int(round(tpp * n_params / tokens_per_step)))


def tpp_for(steps: int, n_params: int, tokens_per_step: int) -> float:
    return steps * tokens_per_step / n_params


def run_cost(steps: int, evals: int, t_step: float, t_eval: float, t_setup: float) -> float:
    """Seconds one run is expected to take: set-up, its steps, its evaluations (every
    steps // evals steps from step 0, and the final one: at most evals + 2)."""
    return t_setup + steps * t_step + (evals + 2) * t_eval


def plan_lengths(lengths: List[float], methods: List[str], n_params: int, tokens_per_step: int,
                 evals: int, t_step: Dict[str, float], t_eval: float, t_setup: float,
                 left: float, first: bool, after: float, min_steps: int) -> List[Dict[str, Any]]:
    """The decision for each length still to start (ascending), given `left` seconds for them
    all. t_step: seconds a step per method (a method not measured yet gets the slowest measured
    one). `first`: nothing has run yet (the first length may then shrink to whatever fits);
    `after`: the longest length already run (a shrunk length must stay longer). Returns per
    length: requested, tokens_per_param, steps, status (run | shrunk | skipped), why."""
    slow = max(t_step.values())
    ts = {m: t_step.get(m, slow) for m in methods}
    out: List[Dict[str, Any]] = []
    stop = ""
    for req in lengths:
        steps = steps_for(req, n_params, tokens_per_step)
        d: Dict[str, Any] = {"requested": req, "tokens_per_param": tpp_for(steps, n_params,
                                                                           tokens_per_step),
                             "steps": steps, "status": "run", "why": ""}
        out.append(d)
        if stop:
            d.update(status="skipped", why=stop)
            continue
        need = sum(run_cost(steps, evals, ts[m], t_eval, t_setup) for m in methods)
        if need <= left:
            left -= need
            first, after = False, d["tokens_per_param"]
            continue
        fixed = sum(run_cost(0, evals, 0.0, t_eval, t_setup) for _ in methods)
        fit = int(max(0.0, left - fixed) / sum(ts.values()))
        fit_tpp = tpp_for(fit, n_params, tokens_per_step)
        per = ", ".join(f"{m} {1e3 * ts[m]:.0f} ms" for m in methods)
        why = (f"{len(methods)} runs of {steps} steps need ~{need:.0f} s, {left:.0f} s of "
               f"planned time left after the shorter lengths (step {per}); {fit} steps fit")
        if fit >= min_steps and (first or (fit >= steps / 2 and fit_tpp > after)):
            d.update(status="shrunk", steps=fit, tokens_per_param=fit_tpp,
                     why=why + f": shrunk to {fit_tpp:.3g} tokens/param")
            stop = f"no time left after {fit_tpp:.3g} tokens/param"
        else:
            rule = (f"fewer than {min_steps} steps" if first or fit < min_steps else
                    "less than half of it" if fit < steps / 2 else
                    f"not longer than {after:.3g} tokens/param, already run")
            d.update(status="skipped", why=why + f": {rule}")
            stop = f"{req:g} tokens/param did not fit"
    return out


def self_test() -> int:
    """The planner's decisions on made-up timings (no ranks, no training)."""
    fast = {"adams": 0.25}  # 3 methods: 0.75 s a step of every length
    kw: Dict[str, Any] = dict(methods=["adams", "scape-0.1", "scape-0.01"], n_params=1_000_000,
                              tokens_per_step=10_000, evals=8, t_eval=0.0, t_setup=0.0,
                              min_steps=5)
    cases = [
        # (what, lengths, t_step, left, first, after, statuses, steps)
        # 0.1, 0.2, 0.4 tokens/param: 10, 20, 40 steps: 52.5 s
        ("everything fits", [0.1, 0.2, 0.4], fast, 100.0, True, 0.0,
         ["run", "run", "run"], [10, 20, 40]),
        # 22.5 s for 0.1 and 0.2, 7.5 s left: 10 steps of 40 fit, less than half
        ("skipped", [0.1, 0.2, 0.4], fast, 30.0, True, 0.0,
         ["run", "run", "skipped"], [10, 20, 40]),
        # 17.5 s left for 0.4: 23 of its 40 steps, and 0.8 is skipped after it
        ("shrunk", [0.1, 0.2, 0.4, 0.8], fast, 40.0, True, 0.0,
         ["run", "run", "shrunk", "skipped"], [10, 20, 23, 80]),
        # the first length shrinks to whatever fits (25 of its 100 steps)
        ("first shrunk", [1.0, 2.0], fast, 18.75, True, 0.0,
         ["shrunk", "skipped"], [25, 200]),
        # ... but not below min_steps
        ("first below min_steps", [1.0], fast, 3.0, True, 0.0, ["skipped"], [100]),
        # a measured step time per method, the slowest for one not measured (0.25 + 0.5 + 0.5)
        ("per-method step times", [0.4], {"adams": 0.25, "scape-0.1": 0.5}, 40.0, False, 0.2,
         ["shrunk"], [32]),
        # a shrunk length must stay longer than the one already run
        ("not longer than the last", [0.4], fast, 22.5, False, 0.35, ["skipped"], [40]),
    ]
    errors = []
    for what, lengths, ts, left, first, after, want, steps in cases:
        p = plan_lengths(lengths, t_step=ts, left=left, first=first, after=after, **kw)
        got = [d["status"] for d in p], [d["steps"] for d in p]
        if got != (want, steps) or any(d["status"] != "run" and not d["why"] for d in p):
            errors.append(f"{what}: {got}, expected {(want, steps)}: {p}")
    p = plan_lengths([0.4], t_step=fast, left=22.5, first=False, after=0.35, **kw)
    if "already run" not in p[0]["why"]:
        errors.append(f"the reason: {p[0]['why']}")
    for e in errors:
        print("gpu_length self-test:", e)
    print(f"gpu_length self-test: {len(cases)} cases, {'ok' if not errors else 'FAILED'}")
    return 1 if errors else 0


class LengthAxis:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t0 = time.monotonic()
        self.end = self.t0 + (a.end_epoch - time.time())
        self.lengths = sorted({float(x) for x in a.lengths.replace(",", " ").split()})
        self.methods = [m for m in a.methods.replace(",", " ").split()]
        for m in self.methods:  # before anything trains: a bad name fails now, on every rank
            cfg = gpu_train.parse_config(m)
            self.check_options(cfg)
        targs = ["--config", self.methods[0], "--device", a.device, "--backend", a.backend,
                 "--shape", a.shape, "--dtype", a.dtype, "--seed", str(a.seed),
                 "--corpus", a.corpus, "--out", a.out]
        if a.fake_hosts:
            targs.append("--fake-hosts")
        self.tr = gpu_train.Trainer(gpu_train.parser().parse_args(targs))
        sh = self.tr.shape
        self.ctx = self.tr.ctx
        self.tokens_per_step = sh.batch * sh.context * self.ctx.size
        cfg = gpu_train.gpt.GPTConfig(vocab=gpu_train.data.VOCAB, context=sh.context,
                                      d_model=sh.d_model, n_layers=sh.n_layers,
                                      n_heads=sh.n_heads)
        self.n_params = gpu_train.gpt.GPT(cfg).n_params()
        self.t_step: Dict[str, float] = {}
        self.t_eval = 0.0
        self.t_setup = 0.0
        self.history: List[Dict[str, Any]] = []
        self.plan: List[Dict[str, Any]] = []
        self.probed = False

    @staticmethod
    def check_options(cfg: Dict[str, Any]) -> None:
        from scape.optim import ScapeAdamS

        opts = {"segment_rms": "entering", "clipstay": "clip_norm", "artifact": "bias_correction"}
        for v in filter(None, (cfg["variant"] or "").split("+")):
            if v not in opts:
                raise SystemExit(f"--methods {cfg['name']}: unknown option {v!r} "
                                 f"(one of {sorted(opts)})")
            if not gc.accepts(ScapeAdamS.__init__, opts[v]):
                raise SystemExit(f"--methods {cfg['name']}: this scape's ScapeAdamS has no "
                                 f"{opts[v]}=")

    def say(self, msg: str) -> None:
        if self.ctx.rank == 0:
            print(f"[length {time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def lr_of(self, method: str) -> float:
        return self.a.lr_adams if method == DENSE or method == "adamw" else self.a.lr_scape

    def left(self) -> float:
        """Seconds to the end, rank 0's reading (every rank decides on the same number)."""
        return float(gc.gather(self.ctx, self.end - time.monotonic())[0])

    def write_plan(self) -> None:
        if self.ctx.rank != 0:
            return
        doc = {"lengths_requested": self.lengths, "methods": self.methods,
               "n_params": self.n_params, "tokens_per_step": self.tokens_per_step,
               "evals": self.a.evals, "probe_steps": self.a.probe_steps,
               "min_steps": self.a.min_steps,
               "lr": {m: self.lr_of(m) for m in self.methods},
               "estimates": {"step_seconds": self.t_step, "eval_seconds": self.t_eval,
                             "setup_seconds": self.t_setup},
               "plan": self.plan, "history": self.history}
        with open(os.path.join(self.a.out, "length_plan.json"), "w") as f:
            json.dump(doc, f, indent=1)

    def replan(self, todo: List[float], first: bool, after: float, when: str) -> None:
        """Plans the lengths `todo` with the estimates so far, in PLAN_SHARE of the time left;
        prints the decisions."""
        left = self.left()
        planned = PLAN_SHARE * max(0.0, left - RESERVE_S - 2 * self.t_eval)
        new = plan_lengths(todo, self.methods, self.n_params, self.tokens_per_step,
                           self.a.evals, self.t_step, self.t_eval, self.t_setup, planned,
                           first, after, self.a.min_steps)
        old = {d["requested"]: d for d in self.plan}
        self.history.append({"when": when, "left_s": left, "plan": new,
                             "step_seconds": dict(self.t_step)})
        ests = ", ".join(f"{m} {1e3 * t:.1f} ms" for m, t in self.t_step.items())
        self.say(f"plan ({when}; {left:.0f} s left, {planned:.0f} s planned; step {ests}, "
                 f"evaluation {self.t_eval:.2f} s, set-up {self.t_setup:.2f} s):")
        for d in new:
            o = old.get(d["requested"])
            line = f"  {d['requested']:g} tokens/param: {d['status']}"
            if d["status"] != "skipped":
                line += f" at {d['tokens_per_param']:.3g} ({d['steps']} steps)"
            if d["why"]:
                line += f" -- {d['why']}"
            if o is not None and (o["status"], o["steps"]) == (d["status"], d["steps"]):
                line += " (unchanged)"
            self.say(line)
        self.plan = [d for d in self.plan if d["requested"] not in todo] + new
        self.write_plan()

    def measured(self, rec: Dict[str, Any]) -> None:
        """The estimates from a finished run: its mean step, evaluation and set-up, each the
        slowest rank's (so that every rank plans on the same numbers)."""
        if rec["steps_done"]:
            self.t_step[rec["config"]] = rec["train_seconds_slowest_rank"] / rec["steps_done"]
        every = gc.gather(self.ctx, [rec["eval_seconds_mean"], rec["setup_seconds"]])
        self.t_eval = max(e[0] for e in every)
        self.t_setup = max(e[1] for e in every)

    def run_one(self, d: Dict[str, Any], method: str, probe: Optional[Any]
                ) -> Optional[Dict[str, Any]]:
        steps = d["steps"]
        t = self.t_step.get(method, max(self.t_step.values()) if self.t_step else None)
        est = run_cost(steps, self.a.evals, t, self.t_eval, self.t_setup) if t else None
        now = time.monotonic()
        # its own deadline, never past the end: 1.5x its estimate + 20 s, or 3x + 30 s for a
        # method whose step has not been measured yet (before any estimate: the end)
        if est is None:
            deadline = self.end
        elif method in self.t_step:
            deadline = min(self.end, now + 1.5 * est + 20)
        else:
            deadline = min(self.end, now + 3 * est + 30)
        self.say(f"{method} at {d['tokens_per_param']:.3g} tokens/param ({steps} steps, lr "
                 f"{self.lr_of(method):g}; estimate {'-' if est is None else f'{est:.0f} s'}, "
                 f"deadline in {deadline - now:.0f} s)")
        rec = self.tr.run(config=method, steps=steps,
                          eval_every=max(1, steps // max(1, self.a.evals)),
                          lr=self.lr_of(method), deadline=deadline, probe=probe)
        if rec is None:
            return None
        rec.update(tokens_per_param_requested=d["requested"],
                   tokens_per_param=rec["tokens"] / self.n_params,
                   tokens_per_param_planned=d["tokens_per_param"],
                   length_status=d["status"], length_why=d["why"], method=method)
        self.measured(rec)
        if self.ctx.rank == 0:
            gc.write_jsonl(os.path.join(self.a.out, "length_runs.jsonl"), rec)
            print(f"[{method}] {d['tokens_per_param']:.3g} tokens/param: {rec['steps_done']} of "
                  f"{steps} steps, val {rec['final_val_loss']:.4f}, "
                  f"{1e3 * rec['train_seconds_slowest_rank'] / max(1, rec['steps_done']):.1f} "
                  f"ms/step, {rec['bytes_per_step']:.0f} B/step, identical "
                  f"{rec['ranks_identical']}"
                  f"{' (TRUNCATED by its deadline)' if rec['truncated'] else ''}", flush=True)
        return rec

    def main(self) -> int:
        a = self.a
        self.say(f"{self.n_params:,} parameters, {self.tokens_per_step:,} tokens a step "
                 f"({self.ctx.size} ranks x {self.tr.shape.batch} x {self.tr.shape.context}), "
                 f"lengths {', '.join(f'{x:g}' for x in self.lengths)} tokens/param, methods "
                 f"{', '.join(self.methods)}, {self.end - time.monotonic():.0f} s to the end")
        # before any estimate: every length as requested
        self.plan = [{"requested": x, "tokens_per_param": tpp_for(
            steps_for(x, self.n_params, self.tokens_per_step), self.n_params,
            self.tokens_per_step), "steps": steps_for(x, self.n_params, self.tokens_per_step),
            "status": "run", "why": ""} for x in self.lengths]
        self.write_plan()
        ok = True
        done_tpp = 0.0
        first = True
        i = 0
        while i < len(self.plan):
            d = self.plan[i]
            if d["status"] == "skipped":
                i += 1
                continue
            if not first:
                self.replan([x["requested"] for x in self.plan[i:]], False, done_tpp,
                            f"before {d['requested']:g} tokens/param")
                d = self.plan[i]
                if d["status"] == "skipped":
                    i += 1
                    continue
            for j, method in enumerate(self.methods):
                probe = None
                k = min(a.probe_steps, max(3, d["steps"] // 2))
                if not self.probed and j == 0 and d["steps"] > k + 1:
                    probe = (k, self.on_probe(i, k))
                rec = self.run_one(d, method, probe)
                if rec is None:  # the probe shrank or skipped this length: start again
                    break
                ok = ok and rec["ranks_identical"]
            else:
                first = False
                done_tpp = d["tokens_per_param"]
                i += 1
                continue
            # the probe abandoned the first run: self.plan[i] holds the new decision (a
            # first length too short to probe is planned with the next one, on its times)
        skipped = [d for d in self.plan if d["status"] != "run"]
        for d in skipped:
            self.say(f"{d['requested']:g} tokens/param {d['status']}: {d['why']}")
        self.say(f"done, {time.monotonic() - self.t0:.0f} s")
        self.write_plan()
        if getattr(self.tr, "comm", None) is not None:
            self.tr.comm.destroy()
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0 if ok else 3

    def on_probe(self, i: int, k: int) -> Any:
        """The probe of the first run (dense AdamS at the first length): plans every length
        from its first steps; False (start again) when the first length itself changes."""
        method = self.methods[0]

        def fn(info: Dict[str, Any]) -> bool:
            self.probed = True
            mine = info["step_s"][2:] or info["step_s"]
            every = gc.gather(self.ctx, [sum(mine) / len(mine), max(info["eval_s"]),
                                         info["setup_s"]])
            self.t_step[method] = max(e[0] for e in every)
            self.t_eval = max(e[1] for e in every)
            self.t_setup = max(e[2] for e in every)
            d = self.plan[i]
            # planned as if the first run started now (its cost counted whole)
            todo = [x["requested"] for x in self.plan[i:]]
            self.replan(todo, True, 0.0, f"after {k} steps of {method}")
            new = self.plan[i]
            if (new["status"], new["steps"]) == ("run", d["steps"]):
                return True
            spent = sum(info["step_s"]) + sum(info["eval_s"]) + info["setup_s"]
            self.say(f"the first length changed ({new['status']}): {method}'s run starts "
                     f"again (the {spent:.1f} s of its probe are lost)")
            return False

        return fn


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-test", action="store_true", help="check the planner and exit")
    ap.add_argument("--lengths", default="0.1,0.2,0.4", help="tokens per parameter")
    ap.add_argument("--methods", default="adams,scape-0.1,scape-0.01",
                    help="gpu_train.py configurations; dense AdamS (adams) first")
    ap.add_argument("--lr-adams", type=float, default=1e-3, help="dense AdamS's peak lr")
    ap.add_argument("--lr-scape", type=float, default=2e-3, help="SCAPE's peak lr")
    ap.add_argument("--end-epoch", type=float, default=0.0,
                    help="time.time() by which every run must have ended")
    ap.add_argument("--evals", type=int, default=8, help="evaluations per run (and step 0)")
    ap.add_argument("--probe-steps", type=int, default=10,
                    help="steps of the first run that plan the rest (at most half its steps)")
    ap.add_argument("--min-steps", type=int, default=20)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "ucx"), default="nccl")
    ap.add_argument("--fake-hosts", action="store_true")
    ap.add_argument("--shape", choices=sorted(gpu_train.SHAPES), default="len20")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "auto"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if not a.out or not a.end_epoch:
        ap.error("--out and --end-epoch are needed")
    if a.end_epoch - time.time() < 10:
        raise SystemExit(f"--end-epoch is {a.end_epoch - time.time():.0f} s away: no time")
    gpu_train.torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return LengthAxis(a).main()


if __name__ == "__main__":
    sys.exit(main())
