"""ScapeAdamS's density schedule keywords (issue 42): density_schedule and density_budget reach
the library (the density of every step against a reference written from scape.h's formulas),
the budget resolves to the longest ramp within it, a state_dict resumed mid-ramp keeps its
shape and gives the uninterrupted bits, and bad values raise naming the keyword. One rank, in
this process."""
from __future__ import annotations

import math
import os
import unittest

import torch

import scape
import scape.launch
from scape.errors import InvalidArgumentError
from scape.optim import ScapeAdamS

_COMM = None


def setUpModule():
    global _COMM
    env = scape.launch.rank_env(0, 1, scape.launch.free_port_pair(), dict(os.environ))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        if k in env:
            os.environ[k] = env[k]
    os.environ.setdefault("SCAPE_SOCKET_IFNAME", "lo")
    _COMM = scape.Communicator.from_env()


def tearDownModule():
    if _COMM is not None:
        _COMM.destroy()


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(31, 23), torch.nn.Tanh(),
                               torch.nn.Linear(23, 5))


def train(m: torch.nn.Module, opt: ScapeAdamS, steps: range):
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(8, 31, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def ref_density(shape: str, rho: float, w: int, t: int) -> float:
    if t == 0:
        return 1.0
    if t >= w:
        return rho
    return 1.0 + (rho - 1.0) * t / w if shape == "linear" else math.exp(t / w * math.log(rho))


def ref_budget(shape: str, rho: float, avg: float, n: int) -> int:
    def mean(w):
        return sum(ref_density(shape, rho, w, t) for t in range(n)) / n
    return max(w for w in range(n + 1) if mean(w) <= avg * (1 + 1e-12))


class ScheduleTest(unittest.TestCase):
    def test_defaults_are_todays(self):
        m = model()
        opt = ScapeAdamS(m.parameters(), _COMM, lr=0.01, density=0.1)
        g = opt.param_groups[0]
        self.assertEqual(g["density_schedule"], "geometric")
        self.assertEqual(g["warmup_steps"], 0)
        self.assertIsNone(g["density_budget"])
        opt.destroy()

    def test_density_per_step_reaches_the_library(self):
        for shape in ("geometric", "linear"):
            for w in (0, 1, 7):
                with self.subTest(shape=shape, w=w):
                    m = model()
                    opt = ScapeAdamS(m.parameters(), _COMM, lr=0.01, density=0.05,
                                     warmup_steps=w, density_schedule=shape)
                    for s in range(10):
                        train(m, opt, range(s, s + 1))
                        info = opt.info()[0]
                        self.assertAlmostEqual(info["next_density"],
                                               ref_density(shape, 0.05, w, s + 1), places=13)
                    opt.destroy()

    def test_budget_resolves_to_the_longest_ramp(self):
        for shape in ("geometric", "linear"):
            for n, avg in ((101, 0.2), (37, 0.05), (1000, 0.0310)):
                with self.subTest(shape=shape, n=n, avg=avg):
                    m = model()
                    opt = ScapeAdamS(m.parameters(), _COMM, lr=0.01, density=0.01,
                                     density_schedule=shape, density_budget=avg, total_steps=n)
                    self.assertEqual(opt.param_groups[0]["warmup_steps"],
                                     ref_budget(shape, 0.01, avg, n))
                    opt.destroy()

    def test_state_dict_resumed_mid_ramp_is_bit_identical(self):
        kw = dict(lr=0.01, density=0.05, warmup_steps=12)
        m1 = model()
        a = ScapeAdamS(m1.parameters(), _COMM, density_schedule="linear", **kw)
        train(m1, a, range(5))
        sd = a.state_dict()
        m2 = model()
        m2.load_state_dict(m1.state_dict())
        train(m1, a, range(5, 20))
        b = ScapeAdamS(m2.parameters(), _COMM, density_schedule="geometric", **kw)
        b.load_state_dict(sd)
        self.assertEqual(b.param_groups[0]["density_schedule"], "linear")
        train(m2, b, range(5, 20))
        self.assertEqual(a.parameter_hash(), b.parameter_hash())
        # and the geometric run is another run (the shape acted)
        m3 = model()
        c = ScapeAdamS(m3.parameters(), _COMM, density_schedule="geometric", **kw)
        train(m3, c, range(20))
        self.assertNotEqual(a.parameter_hash(), c.parameter_hash())
        for o in (a, b, c):
            o.destroy()

    def test_bad_values_raise_naming_the_keyword(self):
        cases = [
            (dict(density_schedule="cosine"), "density_schedule"),
            (dict(density_schedule=1), "density_schedule"),
            (dict(density_budget=0.5), "total_steps"),
            (dict(density_budget=1.5, total_steps=100), "density_budget"),
            (dict(density_budget="x", total_steps=100), "density_budget"),
            (dict(density_budget=True, total_steps=100), "density_budget"),
            (dict(density_budget=0.015, total_steps=100), "density_budget"),  # below 0.0199
            (dict(density_budget=0.2, total_steps=100, warmup_fraction=0.1), "density_budget"),
            (dict(density_budget=0.2, total_steps=100, warmup_steps=3), "warmup_steps"),
        ]
        for kw, arg in cases:
            with self.subTest(kw=kw):
                with self.assertRaises(InvalidArgumentError) as cm:
                    ScapeAdamS(model().parameters(), _COMM, lr=0.01, density=0.01, **kw)
                self.assertEqual(cm.exception.argument, arg, str(cm.exception))
        with self.assertRaises(InvalidArgumentError) as cm:
            ScapeAdamS(model().parameters(), _COMM, density=0.01, density_budget=0.015,
                       total_steps=100)
        self.assertIn("0.0199", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
