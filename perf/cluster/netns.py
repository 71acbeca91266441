"""An emulated cluster on one host (issue 34): P "hosts", each a network namespace with its own
UTS namespace at launch (its own hostname), joined by veth pairs to a bridge in a hub namespace
(the switch). Every link is shaped in both directions, on the rank's eth0 (uplink) and on the
hub's end (downlink): tbf at the link rate, netem below it for the one-way delay, so a message
from rank a to rank b crosses two shaped links (a's NIC, b's NIC) as in a switched network.

Addresses exist only inside the namespaces (10.214.0.0/24, rank r = 10.214.0.(r+1)); the
host's own interfaces, routes and firewall are not touched. Needs root and iproute2 (ip, tc).
"""
from __future__ import annotations

import os
import shlex
import subprocess
from typing import Dict, List, Optional

SUBNET = "10.214.0"


def sh(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p


class Cluster:
    def __init__(self, P: int, tag: Optional[str] = None) -> None:
        self.P = P
        self.tag = tag or f"scl{os.getpid() % 100000}"
        self.hub = self.tag + "h"
        self.ns = [f"{self.tag}r{r}" for r in range(P)]
        self.hub_if = [f"{self.tag}b{r}" for r in range(P)]
        self.up = False
        self.netem: Optional[bool] = None   # whether this kernel has sch_netem (probed)
        self.note = ""

    def addr(self, r: int) -> str:
        return f"{SUBNET}.{r + 1}"

    def create(self) -> None:
        self.up = True
        sh(["ip", "netns", "add", self.hub])
        sh(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        sh(["ip", "-n", self.hub, "link", "set", "lo", "up"])
        for r in range(self.P):
            ns = self.ns[r]
            sh(["ip", "netns", "add", ns])
            sh(["ip", "link", "add", f"{self.tag}a{r}", "netns", ns, "type", "veth", "peer",
                "name", self.hub_if[r], "netns", self.hub])
            sh(["ip", "-n", ns, "link", "set", f"{self.tag}a{r}", "name", "eth0"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", "eth0"])
            # one MTU-sized packet per segment through the shaper (no ethtool here: cap GSO)
            for dev, n in (("eth0", ns), (self.hub_if[r], self.hub)):
                sh(["ip", "-n", n, "link", "set", dev, "gso_max_size", "1500"], check=False)
            sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "-n", self.hub, "link", "set", self.hub_if[r], "master", "br0"])
            sh(["ip", "-n", self.hub, "link", "set", self.hub_if[r], "up"])

    def shape(self, rate_mbit: float, delay_ms: float) -> None:
        """Every link: tbf at rate_mbit (0: no limit), netem delay_ms one way per link. A
        kernel without sch_netem (this VM's has none, and no modules to load) gets no added
        delay: self.netem is False and self.note says so."""
        if self.netem is None:
            n, dev = self.ns[0], "eth0"
            sh(["tc", "-n", n, "qdisc", "del", "dev", dev, "root"], check=False)
            p = sh(["tc", "-n", n, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"],
                   check=False)
            self.netem = p.returncode == 0
            sh(["tc", "-n", n, "qdisc", "del", "dev", dev, "root"], check=False)
            if not self.netem:
                self.note = ("no netem in this kernel (" + p.stderr.strip() + "): links are "
                             "tbf-limited only, latency is the veths' own")
        if not self.netem:
            delay_ms = 0.0
        for r in range(self.P):
            for dev, n in (("eth0", self.ns[r]), (self.hub_if[r], self.hub)):
                sh(["tc", "-n", n, "qdisc", "del", "dev", dev, "root"], check=False)
                if rate_mbit <= 0 and delay_ms <= 0:
                    continue
                if rate_mbit > 0:
                    rate_bps = rate_mbit * 1e6 / 8
                    burst = int(max(16 * 1024, rate_bps * 0.002))   # 2 ms at the rate
                    limit = int(max(256 * 1024, rate_bps * 0.2))    # 200 ms of queue
                    sh(["tc", "-n", n, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                        "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)])
                    parent = ["parent", "1:1", "handle", "10:"]
                else:
                    parent = ["root", "handle", "10:"]
                if delay_ms > 0:
                    sh(["tc", "-n", n, "qdisc", "add", "dev", dev] + parent +
                       ["netem", "delay", f"{delay_ms}ms", "limit", "100000"])

    def qdiscs(self) -> str:
        return sh(["tc", "-n", self.ns[0], "qdisc", "show", "dev", "eth0"]).stdout.strip()

    def counters(self) -> Dict[str, int]:
        """tx/rx bytes of every rank's eth0, read from outside (ip -s link)."""
        out = {}
        for r in range(self.P):
            for k in ("tx_bytes", "rx_bytes"):
                p = sh(["ip", "netns", "exec", self.ns[r], "cat",
                        f"/sys/class/net/eth0/statistics/{k}"])
                out[f"r{r}.{k}"] = int(p.stdout)
        return out

    def cmd(self, r: int, argv: List[str], env: Dict[str, str]) -> List[str]:
        """argv run as host r: its namespace, its own UTS namespace and hostname."""
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        inner = " ".join(shlex.quote(a) for a in argv)
        return ["ip", "netns", "exec", self.ns[r], "unshare", "--uts", "sh", "-c",
                f"hostname {self.tag}-host{r} && exec env {envs} {inner}"]

    def destroy(self) -> None:
        if not self.up:
            return
        for ns in self.ns:
            sh(["ip", "netns", "del", ns], check=False)
        sh(["ip", "netns", "del", self.hub], check=False)
        self.up = False

    def __enter__(self) -> "Cluster":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
