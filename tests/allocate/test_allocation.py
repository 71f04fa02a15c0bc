import json
from pathlib import Path

import pytest

from paperback.allocate.allocation import Allocator, Workload
from paperback.allocate.profile import ProfileConfig, Profiler
from paperback.allocate.solver import InfeasibleBudget
from paperback.kv.policy import build_policy
from paperback.kv.schemes import parse_kv_scheme
from paperback.plan.arithmetic import kv_bytes
from paperback.plan.shape import shape_from_config

from test_profile import sample_text

CONFIG = ProfileConfig(method="rtn", weight_schemes=("W8s-ch", "W4a-g64", "W2a-g64"),
                       kv_formats=("fp16", "int8:r=32", "kivi2:r=32"), windows=1, window_tokens=128,
                       weight_tokens=64, calib_samples=1, additivity_samples=0)


@pytest.fixture
def profile(tiny_lm, char_tokenizer, tmp_path):
    return Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path,
                    progress=False).run()


def smallest_and_largest(allocator):
    groups = allocator.weight_groups() + allocator.kv_groups()
    low = sum(min(o.bytes for o in g.options) for g in groups)
    high = sum(max(o.bytes for o in g.options) for g in groups)
    return allocator.runtime + allocator.fixed_bytes + low, allocator.runtime + allocator.fixed_bytes + high


def test_allocation_fits_the_budget_and_improves_with_it(profile, tiny_lm):
    probe = Allocator(profile, tiny_lm.model, Workload(10 ** 12, 256, 4))
    low, high = smallest_and_largest(probe)
    previous = None
    for fraction in (0.0, 0.2, 0.5, 0.8, 1.0):
        budget = int(low + fraction * (high - low))
        allocation = Allocator(profile, tiny_lm.model, Workload(budget, 256, 4)).allocate()
        assert allocation.total_bytes <= budget
        if previous is not None:
            assert allocation.predicted_kl <= previous + 1e-12
        previous = allocation.predicted_kl
    assert set(allocation.weights.values()) == {"W8s-ch"}  # all the room it wants: the best everywhere
    assert {parse_kv_scheme(spec).format_label for spec in allocation.kv.values()} <= {"fp16", "int8"}


def test_kv_bytes_agree_with_the_planner(profile, tiny_lm, tmp_path):
    """The allocator's per-layer KV bytes sum to what the planner counts for the chosen policy."""
    low, high = smallest_and_largest(Allocator(profile, tiny_lm.model, Workload(10 ** 12, 300, 3)))
    allocation = Allocator(profile, tiny_lm.model, Workload(int((low + high) / 2), 300, 3)).allocate()
    assert len(set(allocation.kv.values())) > 1  # a real mix, so the per-layer sum is exercised
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(allocation.kv_policy_spec()))
    policy = build_policy(tiny_lm.config, policy_file=policy_file)
    assert [policy.scheme_for(i) for i in range(2)] == [parse_kv_scheme(allocation.kv[i]) for i in range(2)]
    planned = kv_bytes(shape_from_config(tiny_lm.config, "tiny", ""), 300, policy, users=3, block_size=32)
    assert allocation.kv_bytes == pytest.approx(planned)


def test_restricted_options_are_the_uniform_baseline(profile, tiny_lm):
    low, high = smallest_and_largest(Allocator(profile, tiny_lm.model, Workload(10 ** 12, 256, 2)))
    allocator = Allocator(profile, tiny_lm.model, Workload(high, 256, 2))
    uniform = allocator.allocate({"W4a-g64"}, {"int8:r=32"})
    assert set(uniform.weights.values()) == {"W4a-g64"} and set(uniform.kv.values()) == {"int8:r=32"}
    assert allocator.allocate().predicted_kl <= uniform.predicted_kl


def test_a_budget_below_the_smallest_model_names_the_nearest_feasible_point(profile, tiny_lm):
    low, _ = smallest_and_largest(Allocator(profile, tiny_lm.model, Workload(10 ** 12, 256, 4)))
    with pytest.raises(InfeasibleBudget, match=r"Nearest feasible: --memory [\d,.]+MiB, or --users \d"):
        Allocator(profile, tiny_lm.model, Workload(low - 1, 256, 4)).allocate()


def test_check_budget_refuses_before_any_profile(tiny_lm):
    from paperback.allocate.allocation import check_budget

    specs = ("fp16", "kivi2:r=32")
    check_budget(tiny_lm.model, Workload(2 ** 30, 256, 1), ("W4a-g64",), specs)
    with pytest.raises(InfeasibleBudget, match="cannot hold 1000 user"):
        check_budget(tiny_lm.model, Workload(310 * 2 ** 20, 512, 1000), ("W4a-g64",), specs)


def test_the_shipped_profiles_are_the_bundled_models_and_allocate_quietly(smollm2, capfd):
    """Every shipped profile is complete and names its model; SmolLM2's match its weights, the default settings
    find theirs (so `demo` and `fit` start at the allocation), and the solve prints nothing (fit --json)."""
    from importlib import resources

    from paperback.allocate.profile import ProfileConfig, Profiler, load_profile
    from paperback.allocate.profile_data import Profile
    from paperback.evaluation.datasets import load_text

    shipped = [Path(str(p)) for p in resources.files("paperback.data").joinpath("profiles").iterdir()
               if p.name.endswith(".json")]
    profiles = {path: load_profile(path) for path in shipped}
    assert {p.model.label for p in profiles.values()} == {"smollm2", "gemma3"}
    for path, profile in profiles.items():
        assert path.name.startswith(profile.model.fingerprint[:16])
        assert profile.to_dict() == json.loads(path.read_text())  # read whole, given back unchanged
    mine = [path for path, p in profiles.items() if p.model.label == "smollm2"]
    assert len(mine) == 2  # the default (anchored) and every cell measured
    for path in mine:
        load_profile(path, smollm2.model)
    default = Profiler(smollm2.model, smollm2.tokenizer, load_text("pydoc"), "pydoc", ProfileConfig(), progress=False)
    profile = Profile.from_dict(default._finished())
    assert profile.estimates is not None and profile.config == ProfileConfig()
    capfd.readouterr()
    allocation = Allocator(profile, smollm2.model, Workload(800 * 2 ** 20, 8192, 8)).allocate()
    assert capfd.readouterr().out == ""
    assert allocation.total_bytes <= 800 * 2 ** 20 and len(set(allocation.weights.values())) > 1


def test_retention_options_come_from_the_profile_and_are_counted_like_the_planner(profile, tiny_lm):
    """Exact sinks are a per-layer option, and so is eviction (when asked for), counted per layer as the
    engine's cache groups hold it."""
    retention = profile.retention
    assert retention.complete and retention.sink == 32
    assert set(retention.tables["sinks"]["0"]) == {"int8", "kivi2"}  # every quantized format, sinks exact
    assert retention.windows and all(len(retention.evict[str(i)]) == len(retention.windows) for i in range(2))
    low, high = smallest_and_largest(Allocator(profile, tiny_lm.model, Workload(10 ** 12, 400, 3)))
    tight = Allocator(profile, tiny_lm.model, Workload(int(low), 400, 3))
    kept = tight.allocate()
    evicting = tight.allocate(evict=True)
    schemes = [parse_kv_scheme(evicting.kv[i]) for i in range(2)]
    assert any(s.window for s in schemes)
    assert evicting.predicted_kl <= kept.predicted_kl and evicting.total_bytes <= low
    policy = build_policy(tiny_lm.config, spec=evicting.kv_policy_spec())
    planned = kv_bytes(shape_from_config(tiny_lm.config, "tiny", ""), 400, policy, users=3, block_size=32)
    assert evicting.kv_bytes == pytest.approx(planned)


@pytest.mark.parametrize("label", ["W3a-g128", "W3a-g64", "W4a-g128", "W4a-g64"])
def test_the_solver_handles_the_shipped_profile_at_every_uniform_budget(smollm2, label):
    """Unscaled costs made HiGHS fail ("Solve error") on the anchored profile at the W4 g64 budget."""
    from importlib import resources

    from paperback.allocate.baselines import param_shapes, policy_bytes, uniform_policy
    from paperback.allocate.profile import load_profile
    from paperback.allocate.solver import solve

    path = resources.files("paperback.data").joinpath("profiles", "16d877b1f385a3d5-71f2ff5d99bdc1f9-3d1d7ac0460c.json")
    allocator = Allocator(load_profile(Path(str(path))), smollm2.model, Workload(10 ** 15, 1, 1))
    units = allocator.units
    budget = policy_bytes(param_shapes(units), uniform_policy(units, allocator.schemes[label]))
    chosen = solve(allocator.weight_groups(), budget)
    uniform = sum(next(o for o in g.options if o.label == label).cost for g in allocator.weight_groups())
    assert sum(o.bytes for o in chosen.values()) <= budget
    assert sum(o.cost for o in chosen.values()) <= uniform
