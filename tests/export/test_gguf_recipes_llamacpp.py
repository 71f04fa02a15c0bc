"""llama.cpp's own tools on paperback's GGUF files: llama-quantize picks the types paperback's recipe table
says, and llama-perplexity runs a paperback file of mixed k-quants.

Needs llama.cpp's tools (`bash benchmarks/peers/setup_llamacpp_tools.sh`, about 15 minutes of compiling), so
it is outside the default suite: run it with `.venv/bin/python -m pytest -m llamacpp`.
"""

import sys
from pathlib import Path

import gguf
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
TOOLS = ROOT / ".llamacpp-tools" / "bin"
pytestmark = [pytest.mark.llamacpp, pytest.mark.slow,
              pytest.mark.skipif(not (TOOLS / "llama-quantize").exists(),
                                 reason="llama.cpp's tools are not built (benchmarks/peers/setup_llamacpp_tools.sh)")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from paperback.export.gguf_quantize import quantize_to_gguf, uniform_types
    from paperback.loading import load_model
    from paperback.quantization.gguf_types import GGUF_TYPES

    lm = load_model("smollm2", "fp32")
    out = tmp_path_factory.mktemp("ref") / "smollm2-f32.gguf"
    quantize_to_gguf(lm, uniform_types(lm.config, GGUF_TYPES["F32"]), out, progress=False)
    return lm, out


@pytest.mark.parametrize("name", ["Q3_K_M", "Q4_K_M", "Q5_K_M", "Q4_0"])
def test_llama_quantize_chooses_the_types_paperbacks_recipe_table_says(reference, tmp_path, name):
    import llamacpp_tools

    from paperback.export.gguf_quantize import gguf_types_for
    from paperback.quantization.gguf_recipes import recipe
    from test_gguf_quantize import gguf_name

    lm, source = reference
    out = tmp_path / f"{name}.gguf"
    llamacpp_tools.quantize(source, out, name)
    theirs = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    ours = gguf_types_for(lm.config, recipe(name))
    assert {gguf_name(p): t.name for p, t in ours.items()} == {n: theirs[n] for n in map(gguf_name, ours)}


def test_llama_perplexity_scores_a_paperback_k_quant_file(reference, tmp_path):
    import llamacpp_tools

    from paperback.export.gguf_quantize import gguf_types_for, quantize_to_gguf
    from paperback.loading import load_model
    from paperback.quantization.gguf_recipes import recipe

    lm, source = reference
    text = ROOT / "paperback" / "data" / "wikitext2_test.txt"
    base = tmp_path / "base.kld"
    ref = llamacpp_tools.kld_base(source, text, base, 512, 4, 2)
    fresh = load_model("smollm2", "fp32")
    out = tmp_path / "paperback-q4km.gguf"
    quantize_to_gguf(fresh, gguf_types_for(fresh.config, recipe("Q4_K_M")), out, progress=False)
    scored = llamacpp_tools.kld(out, text, base, 512, 4, 2)
    assert 0 < scored["kld"] < 0.1 and scored["same_top_p"] > 0.8
    assert abs(scored["perplexity"] / ref["perplexity"] - 1) < 0.1
