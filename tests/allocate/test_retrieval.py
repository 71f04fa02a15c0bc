"""The retrieval probe: what one layer's cache option costs a planted fact's answer, and the allocator's bound."""

from dataclasses import replace

import pytest

from paperback.allocate.allocation import Allocator, Workload
from paperback.allocate.profile import ProfileConfig, Profiler
from paperback.allocate.retrieval import RetrievalProbe, retrieval_prompts
from paperback.errors import PaperbackError
from paperback.kv import KVPolicy, parse_kv_scheme
from test_profile import sample_text

CONFIG = ProfileConfig(method="rtn", weight_schemes=("W8s-ch", "W2a-g64"), kv_formats=("fp16", "kivi2:r=32"),
                       windows=1, window_tokens=128, weight_tokens=64, calib_samples=1, additivity_samples=0)


@pytest.fixture(scope="module")
def measured(tiny_gguf, tmp_path_factory):
    """A tiny model and its profile (retrieval part included), once for the module."""
    from helpers import CharTokenizer
    from paperback.loading import load_model

    lm = load_model(str(tiny_gguf), with_tokenizer=False)
    return lm, Profiler(lm.model, CharTokenizer(256), sample_text(), "sample", CONFIG, tmp_path_factory.mktemp("p"),
                        progress=False).run()


@pytest.fixture
def prompts(char_tokenizer):
    haystack = [ord(c) % 256 for c in sample_text(600, seed=3)]
    return retrieval_prompts(char_tokenizer, haystack, 480, None)


def test_prompts_hold_the_fact_at_each_depth_and_the_answer_at_the_end(prompts, char_tokenizer):
    assert prompts.ids.shape == (2, 480)
    for row, depth in zip(prompts.ids.tolist(), prompts.depths):
        text = "".join(chr(t) for t in row)
        fact_at = text.index(" Note that the access number of ")
        assert abs(fact_at / 480 - depth) < 0.15
        code = text[fact_at:].split(" is ", 1)[1][:6]
        assert text.endswith(f" is {code}") and prompts.answer_tokens == 7  # " 123456", one id per character
        assert "\n\nWhat is the access number" in text[-prompts.tail:]  # the longest row's tail


def test_too_short_a_text_is_refused(char_tokenizer):
    with pytest.raises(PaperbackError, match="need"):
        retrieval_prompts(char_tokenizer, list(range(100)), 480, None)


def test_the_last_layer_alone_is_measured_exactly(tiny_lm, prompts):
    """Past the changed block nothing is approximated when it is the last one: the cell equals a whole run
    with that layer's cache in the format and the others exact."""
    probe = RetrievalProbe(tiny_lm.model, prompts, chunk=32)
    last = tiny_lm.config.num_layers - 1
    for spec in ("kivi2:r=32", "fp16:sink=32,window=96"):
        scheme = parse_kv_scheme(spec)
        whole = probe.kl_with_policy(KVPolicy(parse_kv_scheme("fp32"), {last: scheme}))
        assert probe.kl_with_kv(last, scheme) == pytest.approx(whole, rel=1e-3, abs=1e-7)
    assert probe.kl_with_kv(0, parse_kv_scheme("fp32")) == pytest.approx(0.0, abs=1e-6)
    evicting = probe.kl_with_kv(0, parse_kv_scheme("fp16:sink=32,window=96"))  # the fact is out of the window
    assert evicting > 10 * abs(probe.kl_with_kv(0, parse_kv_scheme("fp16")))


def test_the_profile_measures_retrieval_and_the_allocator_bounds_it(measured):
    tiny_lm, profile = measured
    r = profile.retrieval
    assert r.complete and r.tokens == 512
    windows = profile.retention.windows
    for i in ("0", "1"):
        assert set(r.formats[i]) == {"fp16", "kivi2"} and set(r.evict[i]) == set(map(str, windows))
    allocator = Allocator(profile, tiny_lm.model, Workload(10 ** 12, 400, 1))
    free = allocator.kv_groups(evict=True)
    bound = min(min(cells.values()) for cells in r.evict.values()) / 2
    bounded = allocator.kv_groups(evict=True, retrieval_kl=bound)
    assert all("win" in o.label for g in free for o in g.options if "win" in o.label)
    assert any("win" in o.label for g in free for o in g.options)
    assert not any("win" in o.label for g in bounded for o in g.options)  # every eviction costs more
    for g in bounded:
        assert all(allocator.retrieval_cost(int(g.name[3:]), o.label.split(":")[0].split("+")[0], None) <= bound
                   for o in g.options)
    with pytest.raises(PaperbackError, match="no candidate left"):
        allocator.allocate(evict=True, retrieval_kl=-1.0)


def test_a_profile_without_retrieval_is_refused_when_bounded(measured):
    tiny_lm, profile = measured
    profile = replace(profile, retrieval=None)
    with pytest.raises(PaperbackError, match="no retrieval"):
        Allocator(profile, tiny_lm.model, Workload(10 ** 12, 400, 1)).allocate(retrieval_kl=1.0)


def test_a_finished_profile_from_before_gains_its_retrieval_part(measured, tmp_path):
    """Profiles shipped or cached before retrieval was measured get that part added; the rest is kept."""
    import json

    from helpers import CharTokenizer

    tiny_lm, profile = measured
    old = profile.to_dict()
    old["retrieval"] = None
    profiler = Profiler(tiny_lm.model, CharTokenizer(256), sample_text(), "sample", CONFIG, tmp_path, progress=False)
    profiler.complete_path.write_text(json.dumps(old))
    again = profiler.run()
    assert again.retrieval == profile.retrieval
    assert again.weights == profile.weights and again.kv == profile.kv
