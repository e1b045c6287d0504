"""Environment checks at pre-flight (``trainer_agent/diagnostics/environment.py``): each setting read from an
injected environment and ``/proc`` reader, with the recommended values and the cases that skip."""

from __future__ import annotations

import pytest

from trainer_agent.diagnostics.environment import SOCKET_BUFFER_BYTES, EnvFacts, environment_checks

GPU_MULTI_NODE = EnvFacts(cuda=True, backend="nccl", multi_node=True)
GOOD_ENV = {"CUDA_LAUNCH_BLOCKING": "0", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "2"}


def _proc(rmem: int | None, wmem: int | None):
    values = {"net.core.rmem_max": rmem, "net.core.wmem_max": wmem}
    return lambda name: None if values[name] is None else f"{values[name]}\n"


def _by(env, facts=GPU_MULTI_NODE, read=_proc(SOCKET_BUFFER_BYTES, SOCKET_BUFFER_BYTES)):
    return {name: (status, detail, values) for name, status, detail, values in environment_checks(env, facts, read)}


def test_the_recommended_settings_pass() -> None:
    checks = _by(GOOD_ENV)
    assert {k: v[0] for k, v in checks.items()} == {"cuda_launch_blocking": "pass", "nccl_sockets": "pass",
                                                    "socket_buffers": "pass"}
    assert _by({})["cuda_launch_blocking"][0] == "pass"  # unset is off


def test_blocking_launches_warn_with_the_value_and_why() -> None:
    status, detail, values = _by({**GOOD_ENV, "CUDA_LAUNCH_BLOCKING": "1"})["cuda_launch_blocking"]
    assert status == "warn" and values == {"value": "1"}
    assert "CUDA_LAUNCH_BLOCKING=0" in detail and "waits for the kernel to finish" in detail
    assert _by({"CUDA_LAUNCH_BLOCKING": "1"}, EnvFacts(cuda=False, backend="gloo", multi_node=True))["cuda_launch_blocking"][0] == "skip"


@pytest.mark.parametrize("env, expected", [
    ({}, ["NCCL_NSOCKS_PERTHREAD=unset (recommended 4)", "NCCL_SOCKET_NTHREADS=unset (recommended 2)"]),
    ({"NCCL_NSOCKS_PERTHREAD": "2", "NCCL_SOCKET_NTHREADS": "2"}, ["NCCL_NSOCKS_PERTHREAD=2 (recommended 4)"]),
    ({"NCCL_NSOCKS_PERTHREAD": "16", "NCCL_SOCKET_NTHREADS": "8"}, ["= 128: NCCL refuses more than 64"]),
])
def test_nccl_socket_settings_warn_naming_each_one_off(env, expected) -> None:
    status, detail, _ = _by(env)["nccl_sockets"]
    assert status == "warn"
    for part in expected:
        assert part in detail


@pytest.mark.parametrize("facts, env, why", [
    (EnvFacts(cuda=True, backend="gloo", multi_node=True), {}, "do not use NCCL"),
    (EnvFacts(cuda=True, backend="nccl", multi_node=False), {}, "one node"),
    (GPU_MULTI_NODE, {"NCCL_NET": "IB"}, "NCCL_NET=IB"),
    (EnvFacts(cuda=True, backend="nccl", multi_node=True, infiniband=True), {}, "uses InfiniBand"),
])
def test_nccl_socket_settings_skip_where_sockets_are_not_used(facts, env, why) -> None:
    status, detail, _ = _by(env, facts)["nccl_sockets"]
    assert status == "skip" and why in detail
    # InfiniBand switched off: sockets again, so the settings matter.
    ib_off = _by({"NCCL_IB_DISABLE": "1"}, EnvFacts(cuda=True, backend="nccl", multi_node=True, infiniband=True))
    assert ib_off["nccl_sockets"][0] == "warn"


def test_small_socket_buffers_warn_with_the_sysctl_to_run() -> None:
    status, detail, values = _by(GOOD_ENV, read=_proc(212992, SOCKET_BUFFER_BYTES))["socket_buffers"]
    assert status == "warn" and values == {"net.core.rmem_max": 212992, "net.core.wmem_max": SOCKET_BUFFER_BYTES}
    assert "net.core.rmem_max = 212992" in detail and "wmem_max = 16777216," not in detail
    assert f"sysctl -w net.core.rmem_max={SOCKET_BUFFER_BYTES}" in detail
    assert _by(GOOD_ENV, read=_proc(None, None))["socket_buffers"][0] == "skip"
    assert _by(GOOD_ENV, EnvFacts(cuda=True, backend="nccl", multi_node=False), _proc(1, 1))["socket_buffers"][0] == "skip"


def test_the_process_facts_follow_torchrun(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    facts = EnvFacts.of_process()
    assert facts.backend is None and not facts.multi_node and not facts.cuda  # no process group, CPU
