"""What a GGUF fit may spend and choose from, checked from the model's config before any weight is read.

The budget is a file size, or the size of a named llama.cpp recipe (`--size-of Q4_K_M`: the bytes its
per-tensor types take, so the fitted file is as large as the one `llama-quantize` writes). A file also
holds what no fit chooses: metadata (tokenizer, chat template), the norms at F32, tensor alignment and
paperback's record of the fit; a byte budget pays for those first. Each weight's candidates are the types
whose blocks tile its rows (k-quants need rows of a multiple of 256: SmolLM2's 576 cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import gguf_types_for, tensor_bytes, weight_shapes
from paperback.quantization.gguf_recipes import recipe
from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES, GGUFType, gguf_type

ALIGNMENT = 32  # GGUF's default tensor alignment: at most this much padding after each tensor
RECORD_BYTES_PER_TENSOR = 96  # paperback's record of the fit (param name -> type) in the file's metadata


@dataclass(frozen=True)
class GGUFBudget:
    tensor_bytes: int  # what the fitted weights may take
    fixed_bytes: int  # the rest of the file (metadata, norms, alignment, the fit's record), at most
    file_bytes: int | None = None  # the file size given (--size)
    size_of: str | None = None  # the llama.cpp recipe whose weights' bytes are the budget (--size-of)

    @property
    def label(self) -> str:
        if self.size_of:
            return f"the size of {self.size_of} ({self.tensor_bytes:,} bytes of weights)"
        return f"{self.file_bytes:,} bytes ({self.tensor_bytes:,} of weights)"

    def to_dict(self) -> dict:
        return {"tensor_bytes": self.tensor_bytes, "fixed_bytes": self.fixed_bytes, "file_bytes": self.file_bytes,
                "size_of": self.size_of}


def candidate_types(names) -> tuple[GGUFType, ...]:
    """The named types (llama.cpp's names, case-insensitive), each once; unknown names refused."""
    kinds = tuple(dict.fromkeys(gguf_type(n) for n in names))
    if not kinds:
        raise PaperbackError("give at least one GGUF type to choose from")
    return kinds


DEFAULT_TYPES = candidate_types(QUANTIZED_TYPES)


def tensor_candidates(config, kinds: tuple[GGUFType, ...]) -> dict[str, list[GGUFType]]:
    """{param: the candidate types that tile its rows}; a weight no candidate tiles is refused by name."""
    config.require_dense("a GGUF fit")
    found = {}
    for param, (_, in_features) in weight_shapes(config).items():
        legal = [k for k in kinds if k.can_tile(in_features)]
        if not legal:
            raise PaperbackError(f"{param} has rows of {in_features} weights, which none of the candidate types "
                                 f"({', '.join(k.name for k in kinds)}) can tile (k-quants need multiples of 256, "
                                 "the others of 32)")
        found[param] = legal
    return found


def fixed_bytes(reader) -> int:
    """Bytes of a fitted file besides its weights, from the source file's `gguf.GGUFReader`: its metadata and
    tensor table, every 1-D tensor (norms) at F32, alignment padding and the fit's record, as upper bounds."""
    norms = sum(4 * int(t.n_elements) for t in reader.tensors if len(t.shape) == 1)
    return int(reader.data_offset) + norms + len(reader.tensors) * (ALIGNMENT + RECORD_BYTES_PER_TENSOR)


def min_tensor_bytes(config, candidates: dict[str, list[GGUFType]]) -> int:
    shapes = weight_shapes(config)
    return sum(min(k.tensor_bytes(*shapes[p]) for k in kinds) for p, kinds in candidates.items())


def gguf_budget(source, candidates: dict[str, list[GGUFType]], size: int | None = None,
                size_of: str | None = None) -> GGUFBudget:
    """The budget of `--size BYTES` or `--size-of RECIPE` (exactly one) for the model of `source` (an opened
    `loading.gguf_file.GGUFModelFile`), refused where the smallest mix of the candidates does not fit."""
    if (size is None) == (size_of is None):
        raise PaperbackError("give the file size as --size BYTES or as --size-of a llama.cpp recipe (one of them)")
    config = source.config()
    fixed = fixed_bytes(source.reader)
    if size_of is not None:
        named = recipe(size_of)
        budget = GGUFBudget(tensor_bytes(config, gguf_types_for(config, named)), fixed, size_of=named.name)
    else:
        budget = GGUFBudget(size - fixed, fixed, file_bytes=size)
    smallest = min_tensor_bytes(config, candidates)
    if smallest > budget.tensor_bytes:
        kinds = sorted({k.name for ks in candidates.values() for k in ks}, key=list(GGUF_TYPES).index)
        raise PaperbackError(f"the smallest mix of {', '.join(kinds)} takes {smallest + fixed:,} bytes with the "
                             f"file's {fixed:,} of metadata and norms, over {budget.label if size_of else f'{size:,}'}"
                             "; give a larger size or smaller types")
    return budget
