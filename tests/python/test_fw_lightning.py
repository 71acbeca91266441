"""PyTorch Lightning trains with ScapeAdamS on 2 ranks (issue 43, item 3):
examples/lightning_scape.py, ``Trainer(strategy=ScapeStrategy())``, run through
tests/python/frameworks/run_patched.py with the CPU-only patch of
tests/python/frameworks/cpu_patches_lightning.py.

Needs the frameworks venv (``bash tests/install_frameworks.sh``: pytorch-lightning 2.2.5,
pinned with its dependencies in tests/python/frameworks/requirements-lightning.txt, over
Debian's torch); its python is ``$SCAPE_FRAMEWORKS_PYTHON`` or
``~/.cache/scape/frameworks-venv/bin/python``.

One run of the example (4 Trainer.fit calls, 16 optimizer steps each over 4 epochs, the resumed
one from epoch 2, and 2 refused ones;
about 11 CPU-s, 15-40 s of wall time on 2 shared cores)
checks, on both ranks: no gloo all-reduce at all in any training batch (micro-batches
included; the dense baseline's DDP shows its gradient all-reduce, so the counter sees them),
ScapeAdamS stepped once per global batch (accumulate_grad_batches=2), Trainer's
gradient_clip_val became ScapeAdamS's max_grad_norm, parameters bit-identical, the loss falls,
``fit(ckpt_path=...)`` from the epoch-1 checkpoint bit-identical (parameters and every
micro-batch loss) to the uninterrupted run, at density 1.0 the losses equal Lightning's own
DDPStrategy with TorchAdamS to a relative 1e-5, and the refusals (clipping by value, an
optimizer that is not ScapeAdamS).

The tolerance: the two runs average different fp32 quantities (ScapeAdamS the new momentum
``b1*m + (1-b1)*g``, DDP the gradient ``g``), so the updates differ in the last bits and the
losses drift apart by a few fp32 ulps over 16 steps (2e-7 relative here); 1e-5 is well below
any real difference (an unaveraged, unclipped or twice-clipped gradient moves the loss by 1e-3
or more within a few steps).

``StateViewAssignment`` needs no framework: ScapeAdamS.state accepts ``state[p] = v`` when
nothing changes (what Lightning's ``_optimizers_to_device`` does) and refuses a real change.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import unittest

from _fw_harness import fw_env as _env, require, run_example

SYS_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class Lightning(unittest.TestCase):
    out = ""

    @classmethod
    def setUpClass(cls):
        cls.version = require("pytorch_lightning")
        p = run_example("cpu_patches_lightning", "lightning_scape.py",
                        ["--samples", "128", "--check-resume", "--dense-baseline",
                         "--check-refusals"])
        cls.out = p.stdout
        cls.failure = None
        if p.returncode != 0:
            cls.failure = (f"lightning_scape.py (pytorch-lightning {cls.version}) exited "
                           f"{p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-12000:]}")

    def _has(self, line: str) -> None:
        if self.failure:
            self.fail(self.failure)
        self.assertIn(line, self.out, f"expected {line!r} in the example's output:\n"
                                      f"{self.out[-4000:]}")

    def _num(self, pattern: str) -> re.Match:
        if self.failure:
            self.fail(self.failure)
        m = re.search(pattern, self.out)
        self.assertIsNotNone(m, f"no line matching {pattern!r} in:\n{self.out[-4000:]}")
        return m

    def test_no_gradient_allreduce_by_lightning(self):
        self._has("gloo all-reduces in training batches: 0\n")
        # the counter sees DDP's gradient all-reduce in the dense baseline
        m = self._num(r"dense baseline \(DDPStrategy \+ TorchAdamS\): gloo all-reduces in a "
                      r"training batch up to (\d+) \((\d+) elements; parameters (\d+)\)")
        self.assertGreater(int(m.group(1)), 0)
        self.assertEqual(int(m.group(2)), int(m.group(3)))

    def test_one_step_per_global_batch_and_clipping_routed(self):
        m = self._num(r"micro-batches (\d+), optimizer steps (\d+), global_step (\d+)")
        micro, steps, gstep = map(int, m.groups())
        self.assertEqual(steps, gstep)
        self.assertEqual(2 * steps, micro)  # accumulate_grad_batches 2
        # Trainer's gradient_clip_val is ScapeAdamS's max_grad_norm; restored after fit
        self._has("ScapeAdamS max_grad_norm 1.0, trainer.gradient_clip_val after fit 1.0")

    def test_ranks_identical_and_loss_falls(self):
        self._has("ranks identical: True")
        m = self._num(r"loss first ([\d.]+) last ([\d.]+)")
        self.assertLess(float(m.group(2)), float(m.group(1)))

    def test_resume_is_bit_identical(self):
        for r in (0, 1):
            self._has(f"rank {r}: resume from epoch=1.ckpt bit-identical to the uninterrupted "
                      f"run: True")
        self._has("resume bit-identical on every rank: True")

    def test_density_one_equals_lightning_dense_run(self):
        m = self._num(r"density 1.0 vs dense baseline: (\d+) losses, max relative difference "
                      r"(\S+) \(tolerance")
        self.assertGreater(int(m.group(1)), 0)
        self.assertLessEqual(float(m.group(2)), 1e-5)

    def test_refusals(self):
        self._has("gradient_clip_algorithm='value': refused: ValueError: ScapeStrategy: "
                  "Trainer(gradient_clip_algorithm='value') cannot be applied")
        self._has("torch.optim.SGD: refused: TypeError: ScapeStrategy: optimizer 0 is SGD, "
                  "not scape.optim.ScapeAdamS")


def _state_view_worker() -> None:
    """One rank: ScapeAdamS.state[p] = v is accepted when v equals the state (a copy, a
    mapping of other tensors with equal values, as a device move makes) and refused
    otherwise."""
    import torch

    import scape
    from scape.optim import ScapeAdamS

    comm = scape.Communicator.from_env(timeout_ms=20000)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = ScapeAdamS(m.parameters(), comm, density=0.5)
    results = []

    def expect(ok: bool, what: str, fn) -> None:
        try:
            fn()
            got = True
        except TypeError as e:
            got = False
            msg = str(e)
            assert "read-only" in msg, msg
        results.append((what, got == ok))

    for step in range(2):
        p = m.weight
        cur = opt.state[p]
        moved = {k: v.clone() for k, v in cur.items()}  # equal values, other tensors
        expect(True, f"step {step}: equal copy", lambda: opt.state.__setitem__(p, moved))
        expect(True, f"step {step}: the state itself",
               lambda: opt.state.__setitem__(p, opt.state[p]))
        for q in list(opt.state):  # what Lightning's _optimizers_to_device does
            expect(True, f"step {step}: every parameter",
                   lambda: opt.state.__setitem__(q, {k: v.to("cpu") for k, v in
                                                     opt.state[q].items()}))
        changed = dict(moved, exp_avg=moved["exp_avg"] + 1.0)
        expect(False, "changed exp_avg", lambda: opt.state.__setitem__(p, changed))
        expect(False, "other dtype", lambda: opt.state.__setitem__(
            p, dict(moved, residual=moved["residual"].double())))
        expect(False, "missing key", lambda: opt.state.__setitem__(
            p, {k: v for k, v in moved.items() if k != "step"}))
        expect(False, "extra key", lambda: opt.state.__setitem__(p, dict(moved, extra=1)))
        expect(False, "not a mapping", lambda: opt.state.__setitem__(p, None))
        expect(False, "unknown parameter", lambda: opt.state.__setitem__(
            torch.nn.Parameter(torch.zeros(1)), moved))
        expect(False, "del", lambda: opt.state.__delitem__(p))
        before = opt.state[p]["exp_avg"].clone()
        assert torch.equal(before, cur["exp_avg"])
        m(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    # A wrapper made the way Lightning's LightningOptimizer makes itself (an instance of a
    # subclass of the optimizer's class that forwards attributes to it) must not free the
    # live optimizer's library state when it is dropped.
    import gc

    wrapper = object.__new__(type("Wrapped", (type(opt),), {
        "__getattr__": lambda self, k: getattr(self.__dict__["_optimizer"], k)}))
    wrapper.__dict__["_optimizer"] = opt
    del wrapper
    gc.collect()
    results.append(("a dropped wrapper leaves the optimizer's state",
                    all(g.handle is not None for g in opt._groups)))
    before = opt.info()[0]["step"]
    m(torch.randn(8, 4)).square().sum().backward()
    opt.step()
    results.append(("the optimizer still steps after a wrapper is dropped",
                    opt.info()[0]["step"] == before + 1))
    bad = [w for w, good in results if not good]
    print(f"rank {comm.rank}: state assignments as expected: {not bad} "
          f"({len(results)} cases{'; wrong: ' + ', '.join(bad) if bad else ''})", flush=True)
    opt.destroy()
    try:
        opt.step()
        stepped = True
    except scape.InvalidUsageError as e:
        stepped = "destroyed" not in str(e)
    if stepped:
        bad.append("a step after destroy() did not raise")
        print(f"rank {comm.rank}: a step after destroy() did not say it was destroyed",
              flush=True)
    comm.destroy()
    sys.exit(1 if bad else 0)


class StateViewAssignment(unittest.TestCase):
    def test_assignment_that_changes_nothing_is_accepted(self):
        p = subprocess.run([SYS_PYTHON, "-m", "scape.launch", "-n", "2", "--timeout", "50",
                            os.path.abspath(__file__), "--state-view-worker"],
                           env=_env(), capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        for r in (0, 1):
            self.assertIn(f"rank {r}: state assignments as expected: True", p.stdout)


if __name__ == "__main__":
    if sys.argv[1:] == ["--state-view-worker"]:
        _state_view_worker()
    else:
        unittest.main()
