"""Multi-LoRA on the scheduler side (docs/lora.md): adapter slots, loads and their cost, the
assignment rule, unknown adapters, the lora_aware policy and the lora_affinity router."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers import FixedCost, bundled_policy_names

from sched_lab.config import validate
from sched_lab.core.errors import ConfigError
from sched_lab.core.kv import make_block_manager
from sched_lab.core.lora import LoRASlots, adapter_names
from sched_lab.core.plan import StepFeatures
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.run.experiment import run_experiment
from sched_lab.sim.cost_model import AnalyticCostModel, LoRACost
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS
from sched_lab.sim.replay import replay
from sched_lab.sim.router import get_router
from sched_lab.traces.adapters import assign_adapters


def lora_run(policy, rows, max_loras, max_cpu_loras=None, num_adapters=4, gpu_blocks=64, **options):
    """Replay (id, arrival_s, prompt, output, lora_name) rows, 10 ms a step, checked."""
    bm = make_block_manager(gpu_blocks, 16, 16, 0.0, False)
    slots = LoRASlots(adapter_names(num_adapters), max_loras, max_cpu_loras or max_loras)
    cls = get_policy(policy)
    limits = SchedulerLimits(256, 64 if cls.chunked_prefill else 4096, 4096)
    scheduler = cls(limits, bm, lora=slots, **options)
    reqs = [Request(i, t, p, o, lora_name=name) for i, t, p, o, name in rows]
    result = replay(reqs, scheduler, FixedCost(), check_invariants=True)
    assert result.failure is None, result.failure
    return result, {r.request_id: r for r in result.requests}


def test_one_slot_serializes_adapters_and_lets_others_pass():
    # A, B, C arrive at 0 (prompt 16, 2 tokens each); one slot. Step 0 admits A (loads
    # lora-0), skips B (lora-1 finds no slot), admits C (lora-0 is in use). Step 1 decodes
    # A and C, which finish at 0.02; step 2 loads lora-1 and prefills B; step 3 decodes it.
    rows = [("A", 0.0, 16, 2, "lora-0"), ("B", 0.0, 16, 2, "lora-1"), ("C", 0.0, 16, 2, "lora-0")]
    result, req = lora_run("fcfs", rows, max_loras=1)
    assert list(result.steps["num_lora_loads"]) == [1, 0, 1, 0]
    assert list(result.steps["num_loras"]) == [1, 1, 1, 1]
    assert list(result.steps["num_prefills"]) == [2, 0, 1, 0]
    assert [round(req[k].first_scheduled_s, 6) for k in "ABC"] == [0.0, 0.02, 0.0]
    assert [round(req[k].finish_s, 6) for k in "ABC"] == [0.02, 0.04, 0.02]
    assert {w[0] for w in result.events.waits} == {"max_loras"}  # B's wait, explained
    # two slots: all three in step 0, two adapters loaded, one in use by two requests
    result, req = lora_run("fcfs", rows, max_loras=2)
    assert list(result.steps["num_lora_loads"]) == [2, 0]
    assert list(result.steps["num_loras"]) == [2, 2]


def test_more_slots_than_adapters_is_allowed_and_the_extra_slots_stay_empty(tmp_path):
    # vLLM's max_loras caps a batch's adapters and is not checked against any adapter set;
    # here too: 5 slots for 2 adapters run as 2 slots do (rows as in the test above).
    assert experiment(tmp_path, lora={"max_loras": 16, "num_adapters": 4}).lora.max_loras == 16
    rows = [("A", 0.0, 16, 2, "lora-0"), ("B", 0.0, 16, 2, "lora-1"), ("C", 0.0, 16, 2, "lora-0")]
    result, _ = lora_run("fcfs", rows, max_loras=5, num_adapters=2)
    assert list(result.steps["num_lora_loads"]) == [2, 0]
    assert list(result.steps["num_loras"]) == [2, 2]


def test_slots_evict_the_least_recently_used_unpinned_adapter_into_the_host_lru():
    slots = LoRASlots(adapter_names(4), max_loras=2, max_cpu_loras=3)
    assert slots.acquire("lora-0", set()) and slots.acquire("lora-1", {"lora-0"})
    assert not slots.acquire("lora-0", {"lora-1"})  # resident: no load, now most recent
    assert slots.acquire("lora-2", {"lora-0"})  # lora-1 leaves the GPU, stays on the host
    assert list(slots.gpu) == ["lora-0", "lora-2"] and "lora-1" in slots.host
    assert [slots.residency(a) for a in adapter_names(4)] == [2, 1, 2, 0]
    assert slots.acquire("lora-3", {"lora-2"})  # host holds 3: lora-1 (least recent) drops
    assert list(slots.host) == ["lora-0", "lora-2", "lora-3"] and slots.num_loads == 4
    assert slots.fits("", {"lora-2", "lora-3"}) and slots.fits("lora-3", {"lora-2", "lora-3"})
    assert not slots.fits("lora-0", {"lora-2", "lora-3"})


def test_adapter_bytes_and_load_time_by_hand():
    # Llama-3.1-8B: hidden 4096, 32 heads and 8 KV heads of 128, MLP 14336, 32 layers.
    # in + out per layer: q 4096+4096, k and v 2 x (4096+1024), o 4096+4096,
    # gate and up 2 x (4096+14336), down 14336+4096 = 81,920; rank 16, bf16:
    # 32 x 16 x 81,920 x 2 = 83,886,080 bytes; over 64 GB/s 1.31072 ms, + 1 ms latency.
    m, hw = MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"]
    assert m.lora_dims_per_layer == 81_920
    assert m.lora_adapter_bytes(16) == 83_886_080
    assert LoRACost(16, 1e-3).load_s(m, hw) == pytest.approx(2.31072e-3, rel=1e-9)
    eff = {"flops_efficiency": 1.0, "bandwidth_efficiency": 1.0, "step_overhead_s": 0.0}
    base = AnalyticCostModel(m, hw, **eff)
    lora = AnalyticCostModel(m, hw, **eff, lora=LoRACost(16, 1e-3))
    decode = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0)
    assert lora.step_time(decode, 16) == base.step_time(decode, 16)  # no adapter in it
    # one adapter's decode reads its 83,886,080 bytes once at 4.8 TB/s (memory-bound step)
    one = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0, num_loras=1, num_lora_tokens=1)
    extra = lora.step_time(one, 16) - base.step_time(decode, 16)
    assert extra == pytest.approx(83_886_080 / 4.8e12, rel=1e-6)
    loaded = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0, num_loras=1, num_lora_tokens=1,
                          num_lora_loads=2)  # fmt: skip
    assert lora.step_time(loaded, 16) - lora.step_time(one, 16) == pytest.approx(
        2 * 2.31072e-3, rel=1e-9
    )
    # compute-bound prefill of 8192 tokens: 2 x 8192 x 16 x 81,920 x 32 more FLOPs
    big = StepFeatures(8192, 1, 0, 8192 * 8193 / 2, 0, 0, 1, 0)
    big_lora = StepFeatures(8192, 1, 0, 8192 * 8193 / 2, 0, 0, 1, 0, num_loras=1,
                            num_lora_tokens=8192)  # fmt: skip
    extra = lora.step_time(big_lora, 16) - base.step_time(big, 16)
    assert extra == pytest.approx(2 * 8192 * 16 * 81_920 * 32 / 989e12, rel=1e-6)


def requests(n):
    return [Request(str(i), 0.0, 16, 1) for i in range(n)]


def test_assignment_counts_with_a_fixed_seed():
    names = adapter_names(4)
    uniform, zipf, half = requests(1000), requests(1000), requests(1000)
    assign_adapters(uniform, names, "uniform", seed=0)
    assign_adapters(zipf, names, "zipf", seed=0, zipf_alpha=1.0)
    assign_adapters(half, names, "zipf", seed=0, base_share=0.5)

    def counts(reqs):
        c = Counter(r.lora_name for r in reqs)
        return [c[""], *(c[a] for a in names)]

    # Expected: uniform 250 each; zipf 1 : 1/2 : 1/3 : 1/4 of 1000 = 480, 240, 160, 120;
    # half of them on the base model. These draws (seed 0) are within 2.3 binomial
    # standard deviations of each (uniform: sd 13.7; lora-0 of zipf: sd 15.8).
    assert counts(uniform) == [0, 280, 239, 266, 215]
    assert counts(zipf) == [0, 496, 264, 144, 96]
    assert counts(half) == [509, 242, 134, 72, 43]
    again = [r.lora_name for r in half]
    assign_adapters(half, names, "zipf", seed=0, base_share=0.5)  # idempotent
    assert [r.lora_name for r in half] == again
    own = requests(3)
    own[1].lora_name = "sql"
    assign_adapters(own, names, "uniform", seed=0)
    assert own[1].lora_name == "sql"  # a trace's own adapter stays


def test_an_unknown_adapter_is_rejected_with_a_reason_and_nothing_is_lost():
    rows = [("A", 0.0, 16, 2, "lora-0"), ("B", 0.0, 16, 2, "sql"), ("C", 0.0, 16, 2, "")]
    _, req = lora_run("fcfs", rows, max_loras=1, num_adapters=2)
    assert req["B"].status is RequestStatus.REJECTED
    assert req["B"].reason == (
        "LoRA adapter 'sql' is not one of the 2 configured (lora.num_adapters: lora-0 .. lora-1)"
    )
    assert req["A"].status is req["C"].status is RequestStatus.FINISHED


def experiment(tmp_path, **top):
    raw = {
        "name": "l",
        "trace": {"format": "synthetic", "num_requests": 40, "seed": 0,
                  "arrival": {"process": "poisson", "rate": 20.0},
                  "prompt_len": {"uniform": [16, 64]}, "output_len": {"uniform": [2, 8]}},
        "kv_cache": {"num_gpu_blocks": 512},
        "policies": ["fcfs"],
        **top,
    }  # fmt: skip
    return validate(raw, "exp.yaml", tmp_path)


def test_a_trace_naming_adapters_without_a_lora_section_is_refused_in_one_line(tmp_path):
    reqs = [Request("0", 0.0, 16, 2), Request("1", 0.1, 16, 2, lora_name="sql")]
    with pytest.raises(ConfigError) as e:
        run_experiment(experiment(tmp_path), False, reqs)
    assert str(e.value) == (
        "l: request 1 names LoRA adapter 'sql' and the experiment has no lora: section; "
        "expected one (docs/lora.md) or a trace without lora_name"
    )


def test_the_lora_section_checks_its_keys_in_one_line(tmp_path):
    cfg = experiment(tmp_path, lora={"max_loras": 2, "num_adapters": 8, "assign": "uniform"})
    assert cfg.lora.cpu_loras == 2 and cfg.to_dict()["lora"]["max_lora_rank"] == 16
    assert validate({**cfg.to_dict(), "name": "again"}, "config.yaml", tmp_path).lora == cfg.lora
    assert experiment(tmp_path).lora is None and "lora" not in experiment(tmp_path).to_dict()
    bad = [
        ({"max_loras": 4, "max_cpu_loras": 2},
         "exp.yaml: lora.max_cpu_loras: expected an integer >= lora.max_loras (4), got 2"),
        ({"assign": "random"}, "exp.yaml: lora.assign: expected one of none, uniform, zipf"),
        ({"zipf_alpha": 2.0}, "exp.yaml: lora.zipf_alpha: set only with lora.assign: zipf"),
        ({"base_share": 0.5}, "exp.yaml: lora.base_share: set only with lora.assign: uniform or"),
        ({"max_loras": 0}, "exp.yaml: lora.max_loras: expected an integer"),
        ({"slots": 3}, "exp.yaml: unknown key lora.slots; allowed: max_loras, max_cpu_loras"),
        ({"num_adapters": 10**9},
         "exp.yaml: lora.num_adapters: expected an integer in [1, 100,000], got 1000000000"),
        ({"max_lora_rank": 1024}, "exp.yaml: lora.max_lora_rank: expected an integer in [1, 512]"),
    ]  # fmt: skip
    for section, message in bad:
        with pytest.raises(ConfigError) as e:
            experiment(tmp_path, lora=section)
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)


def test_a_run_reports_loads_and_adapters_per_step(tmp_path):
    lora = {"max_loras": 2, "num_adapters": 4, "assign": "uniform"}
    run = run_experiment(experiment(tmp_path, lora=lora), False)[0]
    steps = run.result.steps
    assert run.summary["num_lora_loads"] == int(steps["num_lora_loads"].sum()) >= 4
    assert 1 <= run.summary["mean_loras_per_step"] <= 2 and steps["num_loras"].max() == 2
    assert set(run.requests["lora_name"]) <= set(adapter_names(4))
    plain = run_experiment(experiment(tmp_path), False)[0]
    assert "num_lora_loads" not in plain.summary and "num_loras" not in plain.result.steps


# A's adapter lora-0 holds the one slot until A ends at 0.04; B (lora-1) waits from 0.001;
# C (lora-0) arrives at 0.035. At 0.04 fcfs admits B (loads lora-1), then C loads lora-0
# again: 3 loads. lora_aware admits C first (lora-0 is still on the GPU): 2 loads, B later.
SWAPS = [("A", 0.0, 16, 4, "lora-0"), ("B", 0.001, 16, 4, "lora-1"), ("C", 0.035, 16, 4, "lora-0")]


def test_lora_aware_loads_fewer_adapters_than_fcfs():
    fcfs, f = lora_run("fcfs", SWAPS, max_loras=1)
    aware, a = lora_run("lora_aware", SWAPS, max_loras=1)
    assert fcfs.steps["num_lora_loads"].sum() == 3
    assert aware.steps["num_lora_loads"].sum() == 2
    assert round(f["B"].first_scheduled_s, 6) == 0.04 and round(f["C"].first_scheduled_s, 6) == 0.08
    assert round(a["C"].first_scheduled_s, 6) == 0.04 and round(a["B"].first_scheduled_s, 6) == 0.08
    # with an aging bound B passed (waited 0.039 s >= 0.02 s), B goes first again
    aged, g = lora_run("lora_aware", SWAPS, max_loras=1, max_wait_s=0.02)
    assert aged.steps["num_lora_loads"].sum() == 3
    assert round(g["B"].first_scheduled_s, 6) == 0.04


def test_the_aging_bound_holds_against_a_stream_of_one_adapter():
    # lora-0 requests every 20 ms until 0.4 s keep lora-0 in use; B (lora-1) arrives at 1 ms.
    stream = [(f"s{i}", 0.02 * i, 16, 4, "lora-0") for i in range(20)]
    rows = [*stream, ("B", 0.001, 16, 4, "lora-1")]
    _, f = lora_run("fcfs", rows, max_loras=1)
    assert f["B"].first_scheduled_s > 0.4  # fcfs: B waits for the stream to end
    _, a = lora_run("lora_aware", rows, max_loras=1, max_wait_s=0.05)
    # aged at 0.051: lora-0 takes no new request, its running ones end within 4 steps
    assert 0.05 < a["B"].first_scheduled_s <= 0.05 + 0.01 + 4 * 0.01 + 1e-9
    assert all(r.status is RequestStatus.FINISHED for r in a.values())


class FakeReplica:
    def __init__(self, num_requests, resident=None):
        self.num_requests, self.resident = num_requests, resident or {}

    def lora_residency(self, name):
        return self.resident.get(name, 0)


def test_lora_affinity_routes_to_the_adapter_within_a_load_bound():
    reps = [FakeReplica(1), FakeReplica(3, {"lora-1": 2}), FakeReplica(2, {"lora-2": 1})]
    router = get_router("lora_affinity")(reps, 0, load_factor=1.25)
    # 6 requests + 1 over 3 replicas: bound ceil(1.25 x 7 / 3) = 3; replica 1 holds 3
    a = Request("a", 0.0, 16, 1, lora_name="lora-1")
    assert router.route(a) == 0
    a.status = RequestStatus.RUNNING  # admitted: no longer counted as sent there
    reps[1].num_requests = 2  # now under the bound: its GPU copy wins over fewer requests
    assert router.route(Request("b", 0.0, 16, 1, lora_name="lora-1")) == 1
    assert router.route(Request("c", 0.0, 16, 1, lora_name="lora-2")) == 2  # host copy
    assert router.route(Request("d", 0.0, 16, 1)) == 0  # base model: fewest requests
    # a new adapter goes to the fewest; the next of it follows (sent, not admitted yet)
    assert router.route(Request("e", 0.0, 16, 1, lora_name="lora-3")) == 0
    reps[0].num_requests = 2
    assert router.route(Request("f", 0.0, 16, 1, lora_name="lora-3")) == 0


def test_a_lora_affinity_cluster_keeps_adapters_on_fewer_replicas(tmp_path):
    lora = {"max_loras": 2, "max_cpu_loras": 4, "num_adapters": 8, "assign": "zipf"}

    def loads(router):
        cfg = experiment(tmp_path, lora=lora, cluster={"replicas": 4, "router": router})
        return run_experiment(cfg, False)[0].summary["num_lora_loads"]

    assert loads("lora_affinity") < loads("round_robin")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", bundled_policy_names())
def test_every_policy_keeps_the_slot_rule_under_kv_pressure(policy, asynchronous):
    # 60 random requests over 3 adapters and the base model, 2 slots, 24 KV blocks of 16
    # tokens (preemptions); check_plan asserts <= max_loras adapters in use, all on the GPU.
    rng = random.Random(7)
    names = ["", "lora-0", "lora-1", "lora-2"]
    rows = [
        (str(i), 0.005 * i, rng.randint(8, 80), rng.randint(1, 40), rng.choice(names))
        for i in range(60)
    ]
    options = {"async_scheduling": True} if asynchronous else {}
    result, req = lora_run(policy, rows, max_loras=2, gpu_blocks=24, **options)
    assert all(r.status is RequestStatus.FINISHED for r in req.values())
    assert result.steps["num_loras"].max() <= 2 and result.steps["num_lora_loads"].sum() >= 3
