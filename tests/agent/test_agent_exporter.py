"""/metrics over HTTP, the metrics each rank serves (its own values everywhere, the job's on the
leader), the config's validation, attach()'s argument checks, state_dict, the data monitor
hand-off."""

from __future__ import annotations

import gc
import math
import os
import socket
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import trainer_agent as ta
from tests.control.spawn import spawn_ranks
from trainguard.protocol.catalog import BY_NAME, JOB, LAYER, RANK, STEP_METRICS, series_per_rank
from trainer_agent.report.exporter import AgentCollector, parse_key, sample_key


def tiny_loop(agent: ta.Agent, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
              nan_at: int | None = None) -> None:
    def poison(grad: torch.Tensor) -> torch.Tensor:
        if agent.step + 1 != nan_at:
            return grad
        grad = grad.clone()
        grad[0, 0] = math.nan  # one non-finite gradient element, produced inside backward
        return grad

    handle = model[0].weight.register_hook(poison)
    for _ in range(steps):
        x = torch.randn(8, 6)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss, tokens=8)
    handle.remove()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("job") == "scrape-job" and labels.pop("run") == "run-7"
            assert labels.pop("rank") == "0"
            out[sample_key(s.name, **labels)] = s.value
    return out


def test_metrics_endpoint_equals_latest_nan_included() -> None:
    model = net()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}])
    registry = CollectorRegistry()
    agent = ta.attach(model, opt, job="scrape-job", run="run-7", registry=registry,
                      config=ta.AgentConfig(metrics_port=0, report_every=2, layer_depth=1))
    try:
        tiny_loop(agent, model, opt, 4, nan_at=4)
        latest = agent.latest()
        scraped = scrape(agent.metrics_url)
        assert scraped.keys() == latest.keys()
        for key, value in latest.items():
            assert (math.isnan(value) and math.isnan(scraped[key])) or scraped[key] == value, key
        assert math.isnan(scraped["trainguard_grad_norm"])
        assert scraped['trainguard_learning_rate{group="1"}'] == 0.5
        assert scraped["trainguard_nonfinite_grads"] == 1
        # Same values through the injected registry, without HTTP.
        assert registry.get_sample_value("trainguard_step", {"job": "scrape-job", "run": "run-7", "rank": "0"}) == 4
        # Every exported name is in the catalogue, with its declared labels.
        for key in latest:
            name, labels = parse_key(key)
            assert set(labels) == set(BY_NAME[name].labels)
        # Every step metric that exists without AMP/accumulation/DP is exported.
        optional = {"trainguard_loss_scale", "trainguard_grad_noise_scale", "trainguard_grad_variance",
                    "trainguard_verify_rel_diff",  # after a gradient recompute check only
                    "trainguard_verify_float32_rel_diff",  # after a float32 recompute of an autocast step only
                    "trainguard_mfu",  # with a known FLOPs count and device peak (trainer_agent/measure/flops.py)
                    # DDP with AgentConfig.comm_timing only (trainer_agent/measure/comm_timing.py)
                    "trainguard_comm_seconds", "trainguard_comm_exposed_seconds", "trainguard_comm_exposed_ratio",
                    *AGREEMENT}  # the leader of several ranks only
        optional |= {m.name for m in STEP_METRICS if m.name.startswith("trainguard_gpu_")}  # NVML, GPU only
        assert {parse_key(k)[0] for k in latest} >= {m.name for m in STEP_METRICS} - optional
    finally:
        agent.close()
    with pytest.raises(OSError):  # close() shut the server down
        urllib.request.urlopen(agent.metrics_url, timeout=2)


def test_port_is_base_plus_local_rank(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=free - 1))
    try:
        assert agent.metrics_url == f"http://127.0.0.1:{free}/metrics"
    finally:
        agent.close()


def test_a_metrics_port_past_65535_is_a_value_error(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="65535"):
        ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                  config=ta.AgentConfig(metrics_port=65530))


def test_per_layer_off_and_no_server() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, per_layer="off",
                                                                          report_every=1, update_ratio="off"))
    try:
        tiny_loop(agent, model, opt, 2)
        got = agent.latest()
        assert agent.metrics_url is None and agent.should_stop is False
        assert not any("layer" in k for k in got)
        assert "trainguard_update_ratio" not in got and "trainguard_effective_lr" not in got
        assert got["trainguard_step"] == 2
    finally:
        agent.close()


@pytest.mark.parametrize("kwargs", [
    {"report_every": 0}, {"report_every": 1.5}, {"metrics_port": 70000}, {"metrics_port": -1},
    {"per_layer": "some"}, {"update_ratio": "always"}, {"layer_depth": 0}, {"sync_every": 0},
    {"controller": "ftp://x"}, {"request_timeout_s": 0}, {"close_timeout_s": math.inf},
    {"vocab_size": 0}, {"vocab_size": 10, "special_ids": (10,)}, {"max_buffered_reports": 0},
    {"grad_noise": "yes"}, {"job_metrics": "leader"}, {"job_metrics": "off"},
    # sizes of what the agent allocates, and waits threading cannot take
    {"report_every": 10**30}, {"report_every": 1_000_001}, {"vocab_size": 10**30}, {"vocab_size": (1 << 22) + 1},
    {"request_timeout_s": 1e12}, {"close_timeout_s": 1e30}, {"snapshot_keep": 65}, {"max_buffered_reports": 10**9},
    # types that iterated or split into something else
    {"preflight_fatal": "nonfinite"}, {"preflight_fatal": None}, {"preflight_fatal": 0}, {"preflight_fatal": ("",)},
    {"special_ids": None}, {"special_ids": 5}, {"special_ids": "ab"}, {"controller": 123}, {"controller": ""},
    {"token": 123}, {"token": ["x"]}, {"token": "a\nb"},
])
def test_config_rejects_bad_values(kwargs) -> None:
    with pytest.raises(ValueError):
        ta.AgentConfig(**kwargs)


def test_config_takes_the_bounds_themselves_and_attach_checks_a_config_changed_since() -> None:
    cfg = ta.AgentConfig(metrics_port=None, report_every=1_000_000, vocab_size=1 << 22, request_timeout_s=86_400,
                         close_timeout_s=86_400, preflight_fatal=["nonfinite"], special_ids=[0, 1], token="t0k3n")
    assert cfg.preflight_fatal == ("nonfinite",) and cfg.special_ids == (0, 1)
    cfg = ta.AgentConfig(metrics_port=None)
    cfg.report_every = 0  # a dataclass: changed after __post_init__ checked it
    model = net()
    with pytest.raises(ValueError, match="report_every must be an int in 1..1000000, got 0"):
        ta.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="j", run="r", config=cfg)


def test_config_reads_controller_and_token_from_env(monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CONTROLLER", "http://127.0.0.1:1")
    monkeypatch.setenv("TRAINGUARD_TOKEN", "secret")
    cfg = ta.AgentConfig()
    assert cfg.controller == "http://127.0.0.1:1" and cfg.token == "secret"
    assert "secret" not in repr(cfg)
    assert (cfg.report_every, cfg.sync_every, cfg.skip_nonfinite) == (10, 1, False)


def test_attach_rejects_bad_arguments() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="job"):
        ta.attach(model, opt, job="bad job", run="r")
    with pytest.raises(ValueError, match="model"):
        ta.attach(object(), opt, job="j", run="r")
    with pytest.raises(ValueError, match="optimizer"):
        ta.attach(model, object(), job="j", run="r")
    with pytest.raises(ValueError, match="config"):
        ta.attach(model, opt, job="j", run="r", config={"report_every": 1})
    frozen = net().requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        ta.attach(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1), job="j", run="r")


def test_state_dict_round_trip() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = ta.AgentConfig(metrics_port=None, report_every=1)
    agent = ta.attach(model, opt, job="j", run="r", config=cfg)
    tiny_loop(agent, model, opt, 3, nan_at=3)
    state = agent.state_dict()
    agent.close()
    assert state["step"] == 3 and state["nonfinite_steps_total"] == 1
    model2 = net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    resumed = ta.attach(model2, opt2, job="j", run="r", config=cfg)
    try:
        resumed.load_state_dict(state)
        tiny_loop(resumed, model2, opt2, 1)
        got = resumed.latest()
        assert got["trainguard_step"] == 4 and got["trainguard_nonfinite_steps_total"] == 1
        with pytest.raises(ValueError):
            resumed.load_state_dict({"step": 1})
    finally:
        resumed.close()


def test_data_monitor_gets_batches_and_bad_batches_are_counted() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, vocab_size=50, special_ids=(0,)))
    try:
        ids = torch.arange(1, 41).reshape(4, 10)
        agent.observe_batch(ids)
        agent.observe_batch(torch.full((2, 5), 99))  # outside the vocabulary: counted, not raised
        tiny_loop(agent, model, opt, 1)
        got = agent.latest()
        assert got["trainguard_data_tokens_total"] == 40
        assert got["trainguard_data_sequences_total"] == 4
        assert got["trainguard_data_special_token_ratio"] == 0
        assert got["trainguard_agent_errors_total"] == 1
    finally:
        agent.close()


def test_taken_port_falls_back_to_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        agent = ta.attach(model, opt, job="j", run="r",
                          config=ta.AgentConfig(metrics_port=taken.getsockname()[1], report_every=1))
        try:
            assert agent.metrics_url is not None
            assert f":{taken.getsockname()[1]}/" not in agent.metrics_url
            tiny_loop(agent, model, opt, 1)
            with urllib.request.urlopen(agent.metrics_url, timeout=5) as r:
                assert b"trainguard_step" in r.read()
            assert agent.latest()["trainguard_agent_errors_total"] == 0
        finally:
            agent.close()


def test_an_address_that_cannot_be_bound_is_counted_not_raised() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # 192.0.2.1 (TEST-NET-1, never a local address): bind fails with EADDRNOTAVAIL
    agent = ta.attach(model, opt, job="j", run="r",
                      config=ta.AgentConfig(metrics_port=0, metrics_host="192.0.2.1", report_every=1))
    try:
        assert agent.metrics_url is None
        tiny_loop(agent, model, opt, 1)
        assert agent.latest()["trainguard_agent_errors_total"] == 1
    finally:
        agent.close()


def test_two_jobs_asking_for_the_same_port_both_serve_and_both_are_discovered(tmp_path, caplog) -> None:
    import httpx

    from tests.control.procs import ControllerProcess, until

    ctl = ControllerProcess(tmp_path / "ctl.db").start()
    agents: list[ta.Agent] = []
    try:
        port = 0  # the first job binds a free port; the second job is configured with that port
        for job in ("job-a", "job-b"):
            model = nn.Linear(3, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            agents.append(ta.attach(model, opt, job=job, run=f"{job}-1", controller=ctl.url,
                                    config=ta.AgentConfig(metrics_port=port, report_every=1)))
            port = port or int(agents[0].metrics_url.rsplit(":", 1)[1].split("/")[0])
        fallbacks = [r for r in caplog.records if "is in use" in r.getMessage()]
        assert len(fallbacks) == 1 and str(port) in fallbacks[0].getMessage()
        ports = [int(a.metrics_url.rsplit(":", 1)[1].split("/")[0]) for a in agents]
        assert ports[0] == port and ports[1] != port  # the second one fell back to a free port
        for a in agents:
            with urllib.request.urlopen(a.metrics_url, timeout=5) as r:
                assert b"trainguard_agent_errors_total" in r.read()
            assert a.latest()["trainguard_agent_errors_total"] == 0.0

        def targets() -> dict[str, str]:
            found = httpx.get(ctl.url + "/v1/sd/targets", timeout=5).json()
            return {t["labels"]["job"]: t["targets"][0] for t in found}

        assert until(lambda: len(targets()) == 2, 30.0)
        assert targets() == {"job-a": f"127.0.0.1:{ports[0]}", "job-b": f"127.0.0.1:{ports[1]}"}
    finally:
        for a in agents:
            a.close()
        ctl.kill()


def _collected(collector: AgentCollector) -> dict[str, float]:
    return {sample_key(s.name, **{k: v for k, v in s.labels.items() if k not in ("job", "run", "rank")}): s.value
            for family in collector.collect() for s in family.samples}


def test_the_collector_serves_the_scopes_it_is_given() -> None:
    values = {"trainguard_loss": 2.5, "trainguard_grad_norm": math.nan, 'trainguard_learning_rate{group="0"}': 0.1,
              'trainguard_layer_grad_norm{layer="blocks.0"}': 3.0, "trainguard_memory_peak_bytes": 1e9}
    everything = AgentCollector(lambda: values, job="j", run="r", rank=3)
    assert _collected(everything).keys() == values.keys()  # default: every scope
    own = _collected(AgentCollector(lambda: values, job="j", run="r", rank=3, scopes={RANK}))
    assert own == {"trainguard_loss": 2.5, "trainguard_memory_peak_bytes": 1e9}
    job = _collected(AgentCollector(lambda: values, job="j", run="r", rank=3, scopes={RANK, JOB}))
    assert job.keys() == values.keys() - {'trainguard_layer_grad_norm{layer="blocks.0"}'}
    assert math.isnan(job["trainguard_grad_norm"])
    with pytest.raises(ValueError, match="scopes"):
        AgentCollector(lambda: values, job="j", run="r", rank=0, scopes={RANK, "leader"})


SERIES_WORLD, SERIES_STEPS = 2, 4


def _series_worker(rank: int, init: str, out: str) -> None:
    """DDP on 2 gloo ranks with most of what adds metrics (two param groups, a GradScaler, the data
    monitor, the skip counters, snapshots, communication timing); each rank scrapes its own
    /metrics after the last report and saves it beside ``latest()``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SERIES_WORLD)
    model = net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}])
    scaler = torch.amp.GradScaler("cpu")
    agent = ta.attach(ddp, opt, job="scrape-job", run="run-7", scaler=scaler,
                      config=ta.AgentConfig(metrics_port=0, report_every=2, layer_depth=1, vocab_size=50,
                                            skip_nonfinite=True, snapshot_every=2, comm_timing=True,
                                            job_metrics=os.environ.get("TG_JOB_METRICS", "rank0")))
    g = torch.Generator().manual_seed(rank)
    for _ in range(SERIES_STEPS):
        agent.observe_batch(torch.randint(1, 50, (4, 10), generator=g))
        loss = ddp(torch.randn(8, 6, generator=g)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        agent.end_step(loss, tokens=8)
    agent.reports.flush(timeout=60)  # the leader's cross-rank work (the ranks' agreement) done
    latest = agent.latest()  # waits for the data monitor's last batches, which the scrape then serves
    scraped = _scraped(agent.metrics_url, rank)
    _close_and_save(agent, ddp, {"scraped": scraped, "latest": latest}, f"{out}/rank{rank}.pt")


def _scraped(url: str, rank: int) -> dict[str, float]:
    """Rank ``rank``'s /metrics of the job "scrape-job", run "run-7", by sample key."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    scraped = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert (labels.pop("job"), labels.pop("run"), labels.pop("rank")) == ("scrape-job", "run-7", str(rank))
            scraped[sample_key(s.name, **labels)] = s.value
    return scraped


def _close_and_save(agent: ta.Agent, ddp: nn.Module, saved: object, path: str) -> None:
    import torch.distributed as dist

    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save(saved, path)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.distributed
def test_a_non_leader_serves_its_own_values_and_the_leader_the_jobs_too(tmp_path) -> None:
    leader, other = spawn_ranks(_series_worker, SERIES_WORLD, tmp_path)
    scope = lambda key: BY_NAME[parse_key(key)[0]].scope  # noqa: E731
    assert leader["latest"]["trainguard_step"] == other["latest"]["trainguard_step"] == SERIES_STEPS
    # The leader serves every value it holds; the other rank only those of its own.
    assert leader["scraped"].keys() == leader["latest"].keys()
    assert other["scraped"].keys() == {k for k in other["latest"] if scope(k) == RANK}
    assert {scope(k) for k in leader["scraped"]} == {RANK, JOB, LAYER}
    # What the other rank no longer serves is a copy: its job-level values equal the leader's.
    left_out = {k: v for k, v in other["latest"].items() if scope(k) == JOB}
    # (the noise scale, computed from every rank's gathered values, may be the leader's alone)
    assert {"trainguard_grad_norm", 'trainguard_learning_rate{group="1"}', "trainguard_update_ratio",
            "trainguard_loss_scale", "trainguard_applied_generation",
            'trainguard_skipped_steps_total{reason="spike"}'} <= left_out.keys()
    assert "trainguard_grad_noise_scale" in leader["scraped"]
    # The elements that train, a job value read per tensor, are read where they are served only.
    assert leader["scraped"]["trainguard_trainable_elements"] == sum(p.numel() for p in net().parameters())
    assert "trainguard_trainable_elements" not in other["latest"]
    # the leader's cross-rank worker kept up with a report every 2 steps: nothing lightened or dropped
    assert leader["scraped"]["trainguard_agent_cross_rank_lightened_total"] == 0.0
    assert leader["scraped"]["trainguard_agent_cross_rank_dropped_total"] == 0.0
    assert all(_same(v, leader["scraped"][k]) for k, v in left_out.items()), {
        k: (v, leader["scraped"][k]) for k, v in left_out.items() if not _same(v, leader["scraped"][k])}
    # ... while its own values are its own (each rank trains on its own batches).
    assert other["scraped"]["trainguard_loss"] != leader["scraped"]["trainguard_loss"]
    assert other["scraped"]["trainguard_data_tokens_total"] == 40 * SERIES_STEPS
    # The series each serves is the catalogue's count for the metrics present (2 layers, 2 param groups).
    present = {parse_key(k)[0] for k in leader["scraped"]}
    assert {parse_key(k)[0] for k in other["scraped"]} == {n for n in present if BY_NAME[n].scope == RANK}
    assert len(leader["scraped"]) == series_per_rank(0, layers=2, param_groups=2, names=present)
    assert len(other["scraped"]) == series_per_rank(1, layers=2, param_groups=2, names=present)


@pytest.mark.distributed
def test_with_job_metrics_all_every_rank_serves_a_copy_of_the_jobs_values(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TG_JOB_METRICS", "all")
    leader, other = spawn_ranks(_series_worker, SERIES_WORLD, tmp_path)
    assert other["scraped"].keys() == other["latest"].keys()
    assert not any(BY_NAME[parse_key(k)[0]].scope == LAYER for k in other["scraped"])  # per_layer stays "rank0"
    present = {parse_key(k)[0] for k in leader["scraped"]}
    # The noise scale (and the batch size it recommends) is made from every rank's gathered values
    # on the leader alone: no other rank holds a copy of it to serve.
    # The ranks' agreement too: the leader compares every rank's gathered fingerprints.
    leaders_own = {"trainguard_grad_noise_scale", "trainguard_grad_variance", "trainguard_recommended_batch_size",
                   "trainguard_grad_desync_rel_diff", "trainguard_param_desync_rel_diff"}
    assert present - {parse_key(k)[0] for k in other["scraped"]} - {n for n in present if BY_NAME[n].scope == LAYER} == leaders_own
    assert len(other["scraped"]) == series_per_rank(1, layers=2, param_groups=2, job_metrics="all",
                                                    names=present - leaders_own)
    assert other["scraped"]["trainguard_grad_norm"] == leader["scraped"]["trainguard_grad_norm"]
    assert other["scraped"]["trainguard_trainable_elements"] == leader["scraped"]["trainguard_trainable_elements"] == 56


AGREEMENT = ("trainguard_grad_desync_rel_diff", "trainguard_param_desync_rel_diff", "trainguard_grad_desync_rank",
             "trainguard_param_desync_rank")


def _agreement_worker(rank: int, init: str, out: str) -> None:
    """DDP on 2 gloo ranks reporting every 2 steps; after step 3 rank 1 moves one weight of layer
    "2" by 1e-3 of the layer's norm. Each rank scrapes its /metrics after the reports of steps 2
    (in sync) and 4 (apart), once the leader's cross-rank work is done, beside the leader's
    per-rank vectors of that report."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = ta.attach(ddp, opt, job="scrape-job", run="run-7", config=ta.AgentConfig(metrics_port=0, report_every=2, layer_depth=1))
    g = torch.Generator().manual_seed(rank)
    seen = {}
    for step in range(1, 5):
        ddp(torch.randn(8, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 3 and rank == 1:
            with torch.no_grad():
                model[2].weight[1, 2] += 1e-3 * math.sqrt(sum(float(p.square().sum()) for p in model[2].parameters()))
        agent.end_step(None)
        if step % 2 == 0:
            agent.latest()
            agent.reports.flush(timeout=60)
            seen[step] = (_scraped(agent.metrics_url, rank),
                          {k: agent.rank_values.get(k) for k in ("grad_desync", "param_desync")})
    _close_and_save(agent, ddp, seen, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_the_leader_serves_the_ranks_agreement_and_a_perturbed_rank_shows_above_the_tolerance(tmp_path) -> None:
    leader, other = spawn_ranks(_agreement_worker, 2, tmp_path)
    for scraped, _ in other.values():  # a job value: the leader's alone
        assert not {parse_key(k)[0] for k in scraped} & set(AGREEMENT)
    in_sync, vectors = leader[2]
    assert vectors["param_desync"] == vectors["grad_desync"] == [0.0, 0.0]
    # the comparison ran and found the replicas equal: 0, not absent; no rank holds a difference
    assert in_sync["trainguard_grad_desync_rel_diff"] == in_sync["trainguard_param_desync_rel_diff"] == 0.0
    assert not {parse_key(k)[0] for k in in_sync} & set(AGREEMENT[2:])
    apart, vectors = leader[4]
    # two replicas: both differ from their middle by the same amount (nothing tells which is wrong)
    assert vectors["param_desync"][0] == vectors["param_desync"][1] > 1e-5
    assert apart["trainguard_param_desync_rel_diff"] == vectors["param_desync"][0]
    assert apart['trainguard_param_desync_rank{worst_layer="2"}'] == 0.0
    assert apart["trainguard_grad_desync_rel_diff"] == max(vectors["grad_desync"])
