"""DeepSpeed trains with ScapeAdamS through its real package on 2 ranks (issue 43, item 1):
examples/deepspeed_scape.py run by the frameworks venv's python (tests/install_frameworks.sh:
deepspeed 0.16.4 over Debian's torch 1.13, gloo) through tests/python/frameworks/run_patched.py
with cpu_patches_deepspeed. It shows: DeepSpeed runs 0 gradient all-reduces (counted at
torch.distributed) while its dense baseline runs one per global batch, ScapeAdamS steps once
per global batch under gradient accumulation, parameters are bit-identical across ranks, the
loss falls, engine.load_checkpoint resumes bit-identically on both ranks, and at density 1.0
the losses and the stepped gradient's norm equal DeepSpeed's own dense run with TorchAdamS; a
bfloat16 model (ScapeAdamS's fp32 masters, no DeepSpeed bf16 section) resumes bit-identically.

The dense tolerance is a relative 1e-5: both runs average the same fp32 gradients, but in
another order (DeepSpeed divides each rank's gradient by the world size and sums; ScapeAdamS
averages b1*m + (1-b1)*g and recovers g), so they differ by a few fp32 roundings per step
(1.3e-7 relative in the losses, 1e-8 in the norms, measured over 8 steps here); a real
difference, such as a gradient summed instead of averaged over the micro-batches, shows as
1e-1 or more. The config refusals are checked in this process (no DeepSpeed needed)."""
from __future__ import annotations

import os
import subprocess
import unittest

import torch

from _fw_harness import FW_PYTHON, INSTALL, fw_env, run_example as launch


def run_example(*extra: str, timeout: float = 110) -> str:
    p = launch("cpu_patches_deepspeed", "deepspeed_scape.py", extra, timeout=timeout)
    if p.returncode != 0:
        # say so plainly when the venv lacks DeepSpeed (checked only then: an import costs
        # seconds)
        q = subprocess.run([FW_PYTHON, "-c", "import deepspeed, pydantic"], capture_output=True,
                           text=True, env=fw_env(), timeout=120)
        if q.returncode != 0:
            raise AssertionError(f"{FW_PYTHON} cannot import deepspeed: {INSTALL}\n"
                                 f"{q.stderr[-1500:]}")
        raise AssertionError(f"deepspeed_scape.py exited {p.returncode}\n{p.stdout[-4000:]}"
                             f"\n{p.stderr[-4000:]}")
    return p.stdout


class DeepSpeedConfigRefusals(unittest.TestCase):
    """check_config / initialize refuse, by key, what would wrap, replace or clip ScapeAdamS
    (before DeepSpeed is imported)."""

    def refused(self, cfg, *words):
        from scape.integrations.deepspeed import initialize

        with self.assertRaises(ValueError) as cm:
            initialize(torch.nn.Linear(2, 2), cfg, lr=1e-3)
        for w in words:
            self.assertIn(w, str(cm.exception))

    def test_refusals_name_the_key_and_the_way_out(self):
        self.refused({"gradient_clipping": 1.0}, "gradient_clipping", "max_grad_norm=1.0")
        self.refused({"zero_optimization": {"stage": 2}}, "zero_optimization", "stage",
                     "sharded=True")
        self.refused({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
                     "offload_optimizer")
        self.refused({"bf16": {"enabled": True}}, "bf16", "master")
        self.refused({"fp16": {"enabled": True}}, "fp16")
        self.refused({"amp": {"enabled": True}}, "amp")
        self.refused({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "optimizer",
                     "lr, betas")

    def test_accepted_and_bad_input(self):
        from scape.integrations.deepspeed import check_config, initialize

        check_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
                      "bf16": {"enabled": False}, "gradient_clipping": 0.0,
                      "scheduler": {"type": "WarmupLR", "params": {}}})
        with self.assertWarns(UserWarning):
            check_config({"prescale_gradients": True})
        with self.assertRaises(TypeError):
            initialize(torch.nn.Linear(2, 2), 42)
        with self.assertRaises(FileNotFoundError):
            initialize(torch.nn.Linear(2, 2), "/nonexistent/ds_config.json")
        with self.assertRaises(TypeError):
            initialize("not a module", {})


class DeepSpeedTwoRanks(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(FW_PYTHON):
            raise AssertionError(f"no frameworks venv python at {FW_PYTHON}: {INSTALL}")

    def test_train_resume_and_dense_baseline(self):
        out = run_example("--check-resume", "--dense-baseline", "--check-bf16-resume",
                          "--steps", "12", "--dense-steps", "8", "--bf16-steps", "6")
        self.assertIn("engine ScapeDeepSpeedEngine optimizer ScapeAdamS", out)
        self.assertIn("falls: True", out)
        self.assertIn("optimizer steps 12 for 12 global batches of 2 micro-batches", out)
        self.assertIn("gradient all-reduces by DeepSpeed per global batch: max 0 "
                      "(allreduce_gradients calls skipped: 24)", out)
        self.assertIn("ranks identical: True", out)
        for r in (0, 1):
            self.assertIn(f"rank {r}: resume from step6 (global step 6) bit-identical to the "
                          f"uninterrupted run: True", out)
        self.assertIn("resume bit-identical on every rank: True", out)
        self.assertIn("bf16 parameters (torch.bfloat16, fp32 masters: True): resume "
                      "bit-identical on every rank: True", out)
        # the counter sees DeepSpeed's own all-reduce where it runs
        self.assertIn("dense baseline (DeepSpeed's all-reduce + TorchAdamS): gradient "
                      "all-reduces per global batch 1; ScapeAdamS density 1.0: 0", out)
        self.assertIn("dense baseline max relative loss difference:", out)
        self.assertIn("(tolerance 1e-05): True", out)
        self.assertNotIn("): False", out)
        self.assertIn("dense baseline max relative gradient-norm difference:", out)


if __name__ == "__main__":
    unittest.main()
