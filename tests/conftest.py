import sys
from pathlib import Path

import pytest

# Tests import their shared helpers (tiny checkpoints) as `helpers`.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    from paperback.loading import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    from paperback.loading import load_model

    return load_model("gemma3")


@pytest.fixture(scope="session")
def wikitext_ids(smollm2):
    from paperback.evaluation import load_text

    return smollm2.tokenizer.encode(load_text("wikitext2")[:20000])
