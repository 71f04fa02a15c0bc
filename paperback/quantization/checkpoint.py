"""paperback's quantized checkpoint: safetensors weights plus a recipe.

A directory holds
  model.safetensors  quantized linears as `<name>.qweight/.scales/.qzeros`,
                     every other tensor in the dtype it was saved in
  recipe.json        format version, model config, method, scheme, modules,
                     calibration, seed, paperback version, per-layer settings
  tokenizer files    so the directory is a complete model for every command
It is written to a temporary sibling and renamed into place at the end, so an
interrupted run never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from paperback import __version__
from paperback.errors import ModelFileError, PaperbackError, UnsupportedModelError
from paperback.models import DecoderLM, ModelConfig, MoEConfig, RopeConfig
from paperback.quantization.head_bands import BandedQuantEmbedding, BandedWeight, band_key, split_band_key
from paperback.quantization.qlinear import QuantEmbedding, QuantLinear
from paperback.quantization.scheme import QuantScheme

RECIPE_FILE = "recipe.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def _packed_class(param_name: str) -> type[QuantLinear]:
    return QuantEmbedding if param_name.endswith("embed_tokens.weight") else QuantLinear


def _replace_linear(model: DecoderLM, param_name: str, make) -> None:
    """Swap the nn.Linear (or nn.Embedding) owning `param_name` for make(old_module)."""
    module_name = param_name.removesuffix(".weight")
    parent_name, _, child = module_name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
    except AttributeError:
        raise ModelFileError(f"no layer '{module_name}' in this model") from None
    setattr(parent, child, make(old))


def swap_in_quantized(model: DecoderLM, quantized: dict) -> DecoderLM:
    """Replace nn.Linear modules named in `quantized` ({param name: QuantizedWeight}) by QuantLinear (a
    BandedWeight's embedding by a BandedQuantEmbedding)."""
    for param_name, q in quantized.items():
        if isinstance(q, BandedWeight):
            _replace_linear(model, param_name, lambda old, q=q: BandedQuantEmbedding.from_banded(q))
            continue
        cls = _packed_class(param_name)
        _replace_linear(model, param_name, lambda old, q=q, cls=cls: cls.from_quantized(q, getattr(old, "bias", None)))
    return model


def save_checkpoint(model: DecoderLM, tokenizer, recipe: dict, out_dir: Path, overwrite: bool = False) -> Path:
    """Write a model whose quantized layers are QuantLinear modules."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return write_checkpoint(state, model.config, tokenizer, recipe, out_dir, overwrite)


def write_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig, tokenizer, recipe: dict, out_dir: Path,
                     overwrite: bool = False) -> Path:
    """Write a checkpoint directory from its tensors (`state`, as a packed model's state dict names them)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_directory(out_dir, overwrite) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "paperback", "version": str(FORMAT_VERSION)})
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(tmp)
        full_recipe = {"format_version": FORMAT_VERSION, "paperback_version": __version__,
                       "model_config": config.to_dict(), **recipe,
                       "weights_sha256": weights_digest(tmp / WEIGHTS_FILE)}
        (tmp / RECIPE_FILE).write_text(json.dumps(full_recipe, indent=2))
    return out_dir


@contextmanager
def atomic_directory(out_dir: Path, overwrite: bool = False):
    """A temporary sibling of `out_dir` to write into; on success it is made readable (publish_modes) and
    renamed into place, on any error or Ctrl-C removed, so a half-written directory never looks complete."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise PaperbackError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
    tmp = out_dir.with_name(out_dir.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish_modes(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_modes(directory: Path) -> None:
    """Files 0644 and directories 0755, whatever the writer chose: safetensors writes its file 0600 (through a
    temporary file), which another user or a serving container's user could not read."""
    for path in [directory, *Path(directory).rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def weights_digest(path: Path) -> str:
    """sha256 of a weights file: a checkpoint records it, and a file changed since is refused."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_recipe(path: Path) -> dict:
    try:
        recipe = json.loads((path / RECIPE_FILE).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path / RECIPE_FILE} is unreadable: {exc}") from None
    if not isinstance(recipe, dict):
        raise ModelFileError(f"{path / RECIPE_FILE} does not hold a JSON object")
    version = recipe.get("format_version")
    if version != FORMAT_VERSION:
        raise UnsupportedModelError(
            f"{path} was written in checkpoint format {version!r} (paperback {recipe.get('paperback_version')}); "
            f"this paperback ({__version__}) reads format {FORMAT_VERSION}"
        )
    return recipe


def verify_weights(recipe: dict, path: Path) -> None:
    """The weights file is the one the recipe was written with (checkpoints from before digests pass)."""
    expected = recipe.get("weights_sha256")
    if expected is None:
        return
    if not (path / WEIGHTS_FILE).is_file():
        raise ModelFileError(f"{path} holds a paperback recipe but no {WEIGHTS_FILE}: the checkpoint is incomplete "
                             "(copy the whole directory)")
    if not isinstance(expected, str) or weights_digest(path / WEIGHTS_FILE) != expected:
        raise ModelFileError(f"{path / WEIGHTS_FILE} has changed since it was written (its sha256 differs from "
                             f"the recipe's): the file is corrupt or was edited")


def checkpoint_kv_policy(path) -> dict | None:
    """The KV policy a checkpoint was fitted with (recipe "kv_policy"), or None: a file, or no policy."""
    path = Path(path)
    if not (path.is_dir() and (path / RECIPE_FILE).is_file()):
        return None
    return read_recipe(path).get("kv_policy")


def _rope(raw, required: bool) -> RopeConfig | None:
    if raw is None and not required:
        return None
    if not isinstance(raw, dict):
        raise TypeError(f"a RoPE setting must be an object, got {raw!r}")
    factors = raw.get("freq_factors")
    return RopeConfig(**{**raw, "freq_factors": tuple(factors) if factors is not None else None})


def config_from_recipe(recipe: dict, path: Path) -> ModelConfig:
    """The ModelConfig saved in a recipe (JSON lists back to tuples), every field checked."""
    raw = recipe.get("model_config")
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path / RECIPE_FILE}: model_config is missing or not an object")
    raw = dict(raw)
    try:
        raw.update(rope=_rope(raw["rope"], True), rope_local=_rope(raw.get("rope_local"), False),
                   layer_types=tuple(raw["layer_types"]))
        if raw.get("moe") is not None:
            if not isinstance(raw["moe"], dict):
                raise TypeError(f"moe {raw['moe']!r} is not an object")
            raw["moe"] = MoEConfig.from_dict(raw["moe"])
        return ModelConfig(**raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path / RECIPE_FILE}: malformed model_config ({exc})") from None


def _scheme(fields, what: str) -> QuantScheme:
    if not isinstance(fields, dict) or type(fields.get("bits")) is not int or \
            type(fields.get("group_size")) not in (int, type(None)) or \
            type(fields.get("symmetric", False)) is not bool:
        raise TypeError(f"{what} {fields!r} needs an integer 'bits', an integer or null 'group_size' and "
                        f"a boolean 'symmetric'")
    return QuantScheme(**fields)


def quantized_layers(recipe: dict) -> dict[str, QuantScheme]:
    """{param name: scheme} of the layers stored packed, a banded head's bands as `band_key(name, b)`; a
    malformed entry is a ModelFileError naming it."""
    layers = recipe.get("layers", {})
    if not isinstance(layers, dict):
        raise ModelFileError(f"{RECIPE_FILE}: 'layers' is not an object")
    schemes = {}
    for name, layer in layers.items():
        try:
            if isinstance(layer, dict) and "bands" in layer:
                bands = layer["bands"]
                if not isinstance(bands, list) or not name.endswith("embed_tokens.weight"):
                    raise TypeError("only the embedding may be banded, as a list of bands")
                for b, band in enumerate(bands):
                    schemes[band_key(name, b)] = _scheme(band["scheme"], f"band {b} scheme")
            else:
                schemes[name] = _scheme(layer["scheme"], "scheme")
        except (KeyError, TypeError, ValueError, PaperbackError) as exc:
            raise ModelFileError(f"{RECIPE_FILE}: layer '{name}' has a malformed scheme ({exc})") from None
    return schemes


def _band_sizes(recipe: dict, name: str) -> list[int]:
    sizes = [band.get("rows") for band in recipe["layers"][name]["bands"]]
    if not all(type(n) is int and n >= 0 for n in sizes):
        raise ModelFileError(f"{RECIPE_FILE}: layer '{name}' has a band without a row count")
    return sizes


def prepare_quantized_model(model: DecoderLM, recipe: dict) -> DecoderLM:
    """Swap meta-device Linear modules for empty QuantLinear shells before loading a checkpoint."""
    banded: dict[str, dict[int, QuantScheme]] = {}
    for key, scheme in quantized_layers(recipe).items():
        param_name, band = split_band_key(key)
        if band is not None:
            banded.setdefault(param_name, {})[band] = scheme
            continue

        def shell(old, scheme=scheme, cls=_packed_class(param_name)):
            out_features, in_features = old.weight.shape
            with torch.device("meta"):
                return cls(in_features, out_features, scheme, getattr(old, "bias", None) is not None)

        _replace_linear(model, param_name, shell)
    for param_name, bands in banded.items():
        sizes = _band_sizes(recipe, param_name)
        schemes = tuple(bands[b] for b in range(len(bands)))

        def banded_shell(old, sizes=sizes, schemes=schemes, name=param_name):
            vocab, in_features = old.weight.shape
            if sum(sizes) != vocab:
                raise ModelFileError(f"{RECIPE_FILE}: the bands of '{name}' hold {sum(sizes)} rows, the "
                                     f"vocabulary {vocab}")
            with torch.device("meta"):
                try:
                    return BandedQuantEmbedding(sizes, in_features, schemes)
                except PaperbackError as exc:
                    raise ModelFileError(f"{RECIPE_FILE}: layer '{name}': {exc}") from None

        _replace_linear(model, param_name, banded_shell)
    return model
