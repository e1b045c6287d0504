"""Fail-open cost: how much slower a training step is while the controller misbehaves, and how
long ``close()`` takes against its deadline. The tests (``tests/control/test_faults.py``) only
check bounds a regression would cross (a step that waited on the controller lasts a request
timeout); the tight figures are measured here, side by side.

Starts one ``trainguard serve`` behind the fault proxy; one agent per fault in this process, a
small model with a fixed 5 ms sleep per step standing for device time. For each fault: ``--steps``
normal steps, then ``--steps`` steps under the fault, interleaved over ``--rounds`` rounds.
Printed per fault: median and max step time, normal vs faulty, their difference and ratio; then
``close(1.0)`` under a black hole (deadline kept?).

    .venv/bin/python bench/fail_open.py [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.tools

import trainer_agent as ta  # noqa: E402
from tests.control.procs import ControllerProcess  # noqa: E402
from tests.tools.faultproxy import FaultProxy  # noqa: E402

FAULTS = ("blackhole", "slow", "reset", "http500", "garbage", "down")


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, agent: ta.Agent, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = model(torch.randn(32, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.005)
        agent.end_step(loss)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ctl = ControllerProcess(Path(tmp) / "trainguard.db").start()
        try:
            print(f"{'fault':<10} {'normal med':>10} {'fault med':>10} {'normal max':>10} {'fault max':>10} {'med ratio':>9} {'max diff':>9}")
            for fault in FAULTS:
                normal: list[float] = []
                faulty: list[float] = []
                with FaultProxy(ctl.port) as proxy:
                    torch.manual_seed(0)
                    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
                    opt = torch.optim.SGD(model.parameters(), lr=0.01)
                    agent = ta.attach(model, opt, job="bench", run=f"bench-{fault}-{time.time_ns()}",
                                      config=ta.AgentConfig(controller=proxy.url, report_every=1, metrics_port=None,
                                                            request_timeout_s=0.5))
                    for _ in range(args.rounds):
                        proxy.set_mode("pass")
                        normal += _steps(model, opt, agent, args.steps)
                        if fault == "slow":
                            proxy.set_mode("pass", latency_s=2.0)
                        else:
                            proxy.set_mode(fault)  # type: ignore[arg-type]
                        faulty += _steps(model, opt, agent, args.steps)
                    proxy.set_mode("pass")
                    agent.close(2.0)
                nm, fm = statistics.median(normal), statistics.median(faulty)
                print(f"{fault:<10} {nm * 1e3:>8.2f}ms {fm * 1e3:>8.2f}ms {max(normal) * 1e3:>8.1f}ms "
                      f"{max(faulty) * 1e3:>8.1f}ms {fm / nm:>8.3f}x {(max(faulty) - max(normal)) * 1e3:>+7.1f}ms")
            with FaultProxy(ctl.port) as proxy:
                model = torch.nn.Linear(4, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                agent = ta.attach(model, opt, job="bench", run=f"bench-close-{time.time_ns()}",
                                  config=ta.AgentConfig(controller=proxy.url, report_every=1, metrics_port=0,
                                                        request_timeout_s=5.0))
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                agent.end_step(1.0)
                proxy.set_mode("blackhole")
                t0 = time.perf_counter()
                agent.close(1.0)
                print(f"close(1.0) with the finish black-holed (request timeout 5 s): {time.perf_counter() - t0:.3f} s")
        finally:
            ctl.kill()


if __name__ == "__main__":
    main()
