"""megatron-core trains with ScapeAdamS on 2 ranks (issue 43, item 2):
examples/megatron_core_scape.py with megatron-core's GPTModel, run through
tests/python/frameworks/run_patched.py with the CPU-only patches of
tests/python/frameworks/cpu_patches_megatron.py.

Needs the frameworks venv (``bash tests/install_frameworks.sh``: megatron-core 0.8.0, pinned in
tests/python/frameworks/requirements-megatron.txt, over Debian's torch); its python is
``$SCAPE_FRAMEWORKS_PYTHON`` or ``~/.cache/scape/frameworks-venv/bin/python``.

One run of the example (about 10 s on 2 cores) checks, on both ranks: no gradient all-reduce
by the framework in a training step (counted; the dense baseline's Megatron DDP shows its
own, so the counter can see them), parameters bit-identical, the loss falls, resume from
iteration 8 bit-identical to the uninterrupted run, at density 1.0 the losses equal megatron's
own dense run (its DDP + finalize_model_grads + TorchAdamS) to a relative 1e-5, and the
refusals (a model in Megatron's or torch's DDP, config.finalize_model_grads_func or
gradient_accumulation_fusion set, use_distributed_optimizer, fp16, a missing checkpoint). A
second, shorter run trains the bf16 model (Megatron-LM's Float16Module) with ScapeAdamS's fp32
masters and resumes it bit-identically.

The tolerance: the two runs average different fp32 quantities (ScapeAdamS the new momentum
``b1*m + (1-b1)*g``, Megatron's DDP the gradient ``g``), so the updates differ in the last bits
and the losses drift apart by a few fp32 ulps over 16 steps (4e-7 relative here); 1e-5 is
well below any real difference (an unaveraged or wrongly clipped gradient moves the loss by
1e-3 or more within a few steps).
"""
from __future__ import annotations

import re
import unittest

from _fw_harness import require, run_example

STEPS = 16


class MegatronCore(unittest.TestCase):
    out = ""

    @classmethod
    def setUpClass(cls):
        cls.version = require("megatron.core")
        p = run_example("cpu_patches_megatron", "megatron_core_scape.py",
                        ["--steps", str(STEPS), "--check-resume", "--dense-baseline",
                         "--check-refusals"])
        cls.out = p.stdout
        cls.failure = None
        if p.returncode != 0:
            cls.failure = (f"megatron_core_scape.py (megatron-core {cls.version}) exited "
                           f"{p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}")

    def _has(self, line: str) -> None:
        self.assertIn(line, self.out, f"missing {line!r} in the example's output:\n"
                                      f"{self.out[-4000:]}")

    def test_example_passes_all_its_checks(self):
        self.assertIsNone(self.failure, self.failure)
        self._has("all checks passed: True")

    def test_no_gradient_allreduce_by_the_framework(self):
        self._has(f"framework gradient all-reduces in {STEPS} training steps: 0 (0 elements")
        # the counter sees Megatron's own: its DDP all-reduces every gradient once per step
        m = re.search(r"dense baseline \(megatron DDP \+ finalize_model_grads \+ TorchAdamS\): "
                      r"framework gradient all-reduces in \d+ steps: (\d+) \((\d+) elements\); "
                      r"ScapeAdamS at density 1.0: (\d+)", self.out)
        self.assertIsNotNone(m, self.out[-3000:])
        self.assertGreaterEqual(int(m.group(1)), STEPS)
        m2 = re.search(r"parameters: (\d+);", self.out)
        self.assertIsNotNone(m2, self.out[-3000:])
        self.assertEqual(int(m.group(2)), STEPS * int(m2.group(1)))
        self.assertEqual(int(m.group(3)), 0)

    def test_megatron_param_groups(self):
        self._has("param groups equal megatron-core's _get_param_groups: True")
        self._has("wd_mult 0.0 weight_decay 0.0")  # norms and biases: no weight decay

    def test_ranks_identical_and_loss_falls(self):
        self._has("ranks identical: True")
        self._has("loss falls: True")

    def test_resume_bit_identical(self):
        self._has(f"saved iteration {STEPS // 2}: iter_{STEPS // 2:07d}/mp_rank_00/"
                  f"scape_optim_dp_rank_000.pt")
        for r in (0, 1):
            self._has(f"rank {r}: resume from iteration {STEPS // 2} bit-identical to the "
                      f"uninterrupted run: True")
        self._has("resume bit-identical on every rank: True")
        self._has("resumed losses equal the uninterrupted run's: True")

    def test_density_one_equals_megatron_dense_run(self):
        self._has("density 1.0 equals the dense run: True")
        a = re.search(r"density 1.0 losses: ([\d. ]+)\n", self.out)
        b = re.search(r"dense run losses: +([\d. ]+)\n", self.out)
        self.assertTrue(a and b, self.out[-3000:])
        xs, ys = [float(v) for v in a.group(1).split()], [float(v) for v in b.group(1).split()]
        self.assertEqual(len(xs), STEPS)
        self.assertEqual(len(ys), STEPS)
        for x, y in zip(xs, ys):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(y) + 2e-6)  # + the printed rounding
        self.assertLess(ys[-1], ys[0] - 0.5)  # the dense run learns: the comparison means something

    def test_bf16_with_fp32_masters(self):
        """Megatron-LM's mixed precision (TransformerConfig bf16, the model in Float16Module):
        ScapeAdamS holds the fp32 masters, trains, and resumes bit-identically."""
        p = run_example("cpu_patches_megatron", "megatron_core_scape.py",
                        ["--steps", "8", "--bf16", "--check-resume"], timeout=120)
        self.assertEqual(p.returncode, 0, f"megatron_core_scape.py --bf16 exited "
                                          f"{p.returncode}\n{p.stdout[-4000:]}\n"
                                          f"{p.stderr[-3000:]}")
        self.assertIn("bfloat16 (fp32 masters in ScapeAdamS)", p.stdout)
        self.assertNotIn("float32", p.stdout.split("groups:")[1].split("\n")[0])
        for line in ("framework gradient all-reduces in 8 training steps: 0 (0 elements",
                     "ranks identical: True", "resume bit-identical on every rank: True",
                     "all checks passed: True"):
            self.assertIn(line, p.stdout, p.stdout[-3000:])

    def test_refusals(self):
        self._has("refusals (megatron DDP, torch DDP, finalize_model_grads_func, "
                  "gradient_accumulation_fusion, use_distributed_optimizer, fp16, lr keyword, "
                  "missing checkpoint) with clear errors on every rank: True")


if __name__ == "__main__":
    unittest.main()
