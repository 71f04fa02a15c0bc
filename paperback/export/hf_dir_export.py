"""An unquantized model as a Hugging Face directory (config.json, model.safetensors, tokenizer files) that
transformers and vLLM load: what `paperback moefy` writes."""

from __future__ import annotations

import json
from pathlib import Path

from paperback.errors import PaperbackError
from paperback.export.hf_config import hf_config, hf_parameter_name
from paperback.export.hf_export import DTYPES
from paperback.models import DecoderLM


def save_hf_dir(model: DecoderLM, tokenizer, out_dir: Path, dtype: str = "float32", overwrite: bool = False,
                extra_files: dict[str, str] | None = None) -> Path:
    """Write `model` (and `tokenizer`, when given) to `out_dir` atomically; extra_files: {name: text}."""
    from safetensors.torch import save_file

    from paperback.quantization.checkpoint import atomic_directory

    if dtype not in DTYPES:
        raise PaperbackError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    config = model.config
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()))
    hf = hf_config(config, dtype, getattr(tokenizer, "bos_token_id", None), (eos[0] if len(eos) == 1 else eos) or None)
    state = {hf_parameter_name(config, name): t.detach().to(DTYPES[dtype]).contiguous()
             for name, t in model.state_dict().items() if not (config.tie_word_embeddings and name == "lm_head.weight")}
    with atomic_directory(Path(out_dir), overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(tmp)
            if eos:
                (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out_dir)
