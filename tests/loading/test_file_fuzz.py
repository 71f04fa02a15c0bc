"""A seeded fuzz of damaged model files: targeted field corruptions of the bundled GGUF, random truncations and
byte flips, and damaged checkpoints. Every case either loads or fails with a one-line PaperbackError; nothing
else escapes. A corruption that changes what the model means (a shape, a count, a type, a token id, a number
the maths reads) is refused, never accepted silently; every change to a checkpoint's weights is refused."""

import json
import random
import shutil
import warnings

import gguf
import numpy as np
import pytest

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.errors import PaperbackError
from paperback.loading import load_model
from paperback.loading.sources import resolve_model
from paperback.quantization import QuantScheme
from paperback.quantization.checkpoint import RECIPE_FILE, WEIGHTS_FILE, save_checkpoint, swap_in_quantized
from paperback.quantization.model_pass import QuantizeConfig, quantize_model

ARCH = "llama"


def loads(path, with_tokenizer=False) -> bool:
    """True if the file loads; False if refused with a one-line PaperbackError; anything else fails the test."""
    try:
        load_model(str(path), with_tokenizer=with_tokenizer)
        return True
    except PaperbackError as exc:
        assert str(exc) and "\n" not in str(exc).strip(), repr(exc)
        return False


class Layout:
    """Where the bundled GGUF keeps what the corruptions change: parsed once (5 s for a 49k vocabulary), then
    every case patches a copy of the bytes and writes it."""

    def __init__(self, path):
        reader = gguf.GGUFReader(path)
        base = reader.data.ctypes.data
        self.data = path.read_bytes()
        self.fields = {key: (f.parts[-1].ctypes.data - base, f.parts[-1].dtype) for key, f in reader.fields.items()
                       if len(f.parts[-1]) == 1}
        self.tensors = {t.name: [(p.ctypes.data - base, p.dtype, int(p[0])) for p in t.field.parts[-2:]]
                        for t in reader.tensors}
        merges = reader.fields["tokenizer.ggml.merges"]
        first = merges.parts[merges.data[0]]
        self.first_merge = (first.ctypes.data - base, len(first))

    @staticmethod
    def put(data: bytearray, at: int, dtype, value) -> None:
        raw = np.array([value]).astype(dtype).tobytes()
        data[at:at + len(raw)] = raw

    def field(self, key, value):
        def corrupt(data):
            self.put(data, *self.fields[key], value)
        return corrupt

    def tensor(self, name, type_=None, offset_from=None, offset=None):
        def corrupt(data):
            (type_at, type_dtype, _), (offset_at, offset_dtype, _) = self.tensors[name]
            if type_ is not None:
                self.put(data, type_at, type_dtype, int(type_))
            if offset_from is not None:
                self.put(data, offset_at, offset_dtype, self.tensors[offset_from][1][2])
            if offset is not None:
                self.put(data, offset_at, offset_dtype, offset)
        return corrupt

    def broken_merges(self, data):
        at, length = self.first_merge
        data[at:at + length] = b"#" * length  # the first merge loses its separating space

    def write(self, path, corrupt):
        data = bytearray(self.data)
        corrupt(data)
        path.write_bytes(bytes(data))
        return path


F16, Q8_0 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
# (name, corruption of the layout): each must be refused.
TARGETED = [
    ("zero heads", lambda g: g.field(f"{ARCH}.attention.head_count", 0)),
    ("zero kv heads", lambda g: g.field(f"{ARCH}.attention.head_count_kv", 0)),
    ("2**32-1 blocks", lambda g: g.field(f"{ARCH}.block_count", 2 ** 32 - 1)),
    ("huge embedding", lambda g: g.field(f"{ARCH}.embedding_length", 2 ** 31)),
    ("zero feed-forward", lambda g: g.field(f"{ARCH}.feed_forward_length", 0)),
    ("2**32-1 context", lambda g: g.field(f"{ARCH}.context_length", 2 ** 32 - 1)),
    ("context of 1", lambda g: g.field(f"{ARCH}.context_length", 1)),
    ("huge BOS id", lambda g: g.field("tokenizer.ggml.bos_token_id", 10 ** 9)),
    ("huge EOS id", lambda g: g.field("tokenizer.ggml.eos_token_id", 2 ** 32 - 1)),
    ("NaN epsilon", lambda g: g.field(f"{ARCH}.attention.layer_norm_rms_epsilon", float("nan"))),
    ("inf RoPE base", lambda g: g.field(f"{ARCH}.rope.freq_base", float("inf"))),
    ("norm relabelled F16", lambda g: g.tensor("blk.0.attn_norm.weight", F16)),
    ("matrix relabelled Q8_0", lambda g: g.tensor("blk.1.ffn_down.weight", Q8_0)),
    ("overlapping tensors", lambda g: g.tensor("blk.2.attn_k.weight", offset_from="blk.2.attn_q.weight")),
    ("offset near 2**64", lambda g: g.tensor("blk.2.attn_k.weight", offset=2 ** 64 - 64)),
]


@pytest.fixture(scope="module")
def bundled():
    return Layout(resolve_model("smollm2").path)


@pytest.mark.parametrize("name, corruption", TARGETED, ids=[n for n, _ in TARGETED])
def test_targeted_corruptions_of_the_bundled_gguf_are_refused(tmp_path, bundled, name, corruption):
    with warnings.catch_warnings(record=True) as printed:
        warnings.simplefilter("always")
        assert not loads(bundled.write(tmp_path / "model.gguf", corruption(bundled))), name
    assert not printed, [str(w.message) for w in printed]  # a clean error only: no numpy overflow warning first


def test_a_corrupt_vocabulary_is_refused(tmp_path, bundled):
    assert not loads(bundled.write(tmp_path / "model.gguf", bundled.broken_merges), with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    write_llama_gguf(tiny_llama_hf(num_hidden_layers=2, hidden_size=64, intermediate_size=96), path)
    return path


def test_random_truncations_and_byte_flips_never_escape(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    header = gguf.GGUFReader(tiny_gguf).data_offset
    rng = random.Random(7)
    refused = 0
    for case in range(120):
        damaged = bytearray(data)
        if case % 3 == 0:
            damaged = damaged[:rng.randrange(len(data))]
        else:  # flips in the header and metadata, where every byte is structure or meaning
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(header)] ^= 1 << rng.randrange(8)
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(bytes(damaged))
        ok = loads(path)
        refused += not ok
        if case % 3 == 0:
            assert not ok, f"a file truncated to {len(damaged)} of {len(data)} bytes loaded"
        path.unlink()
    assert refused > 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_gguf):
    lm = load_model(str(tiny_gguf), with_tokenizer=False)
    results = quantize_model(lm.model, QuantizeConfig("rtn", QuantScheme(4, 32)), progress=False)
    swap_in_quantized(lm.model, results)
    out = tmp_path_factory.mktemp("ckpt") / "tiny-w4"
    save_checkpoint(lm.model, None, {"method": "rtn", "layers": {
        n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}, out)
    assert loads(out)
    return out


def damaged_copy(checkpoint, tmp_path, weights=None, recipe=None):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    if weights is not None:
        (path / WEIGHTS_FILE).write_bytes(weights((path / WEIGHTS_FILE).read_bytes()))
    if recipe is not None:
        text = (path / RECIPE_FILE).read_bytes()
        (path / RECIPE_FILE).write_bytes(recipe(text))
    return path


def relabel(old: bytes, new: bytes):
    def change(data: bytes) -> bytes:
        length = int.from_bytes(data[:8], "little")
        return data[:8] + data[8:8 + length].replace(old, new, 1) + data[8 + length:]
    return change


def edit_recipe(edit):
    def change(text: bytes) -> bytes:
        recipe = json.loads(text)
        edit(recipe)
        return json.dumps(recipe).encode()
    return change


def first_layer(recipe) -> dict:
    return next(iter(recipe["layers"].values()))


CHECKPOINT_DAMAGE = [
    ("F32 relabelled I32", {"weights": relabel(b'"F32"', b'"I32"')}),
    ("F16 relabelled BF16", {"weights": relabel(b'"F16"', b'"BF16"')}),
    ("recipe is a list", {"recipe": lambda t: b"[1, 2]"}),
    ("recipe not UTF-8", {"recipe": lambda t: t.replace(b'"rtn"', b'"\xff\xfe"')}),
    ("scheme bits a string", {"recipe": edit_recipe(lambda r: first_layer(r)["scheme"].update(bits="4"))}),
    ("scheme missing", {"recipe": edit_recipe(lambda r: first_layer(r).pop("scheme"))}),
    ("null RoPE", {"recipe": edit_recipe(lambda r: r["model_config"].update(rope=None))}),
    ("NaN epsilon", {"recipe": edit_recipe(lambda r: r["model_config"].update(rms_norm_eps=float("nan")))}),
    ("layers a list", {"recipe": edit_recipe(lambda r: r.update(layers=[1]))}),
    ("huge layer count", {"recipe": edit_recipe(lambda r: r["model_config"].update(num_layers=2 ** 40))}),
]


@pytest.mark.parametrize("name, damage", CHECKPOINT_DAMAGE, ids=[n for n, _ in CHECKPOINT_DAMAGE])
def test_damaged_checkpoints_are_refused(tmp_path, checkpoint, name, damage):
    assert not loads(damaged_copy(checkpoint, tmp_path, **damage)), name


def test_a_checkpoint_without_its_weights_file_is_refused_by_name(tmp_path, checkpoint):
    path = damaged_copy(checkpoint, tmp_path)
    (path / WEIGHTS_FILE).unlink()
    with pytest.raises(PaperbackError, match=f"holds a paperback recipe but no {WEIGHTS_FILE}"):
        load_model(str(path), with_tokenizer=False)


def test_every_changed_byte_of_checkpoint_weights_is_refused(tmp_path, checkpoint):
    size = (checkpoint / WEIGHTS_FILE).stat().st_size
    rng = random.Random(11)
    for case in range(40):
        at = rng.randrange(size)

        def flip(data: bytes, at=at) -> bytes:
            return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]

        def cut(data: bytes, at=at) -> bytes:
            return data[:at]

        path = damaged_copy(checkpoint, tmp_path / str(case), weights=flip if case % 2 else cut)
        assert not loads(path), f"case {case}: a changed byte at {at} of {size} was accepted"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    tiny_llama_hf(num_hidden_layers=2, hidden_size=64, intermediate_size=96).save_pretrained(path)
    assert loads(path)
    return path


BAD_HF_VALUES = [("num_attention_heads", 0), ("hidden_size", "abc"), ("max_position_embeddings", 2 ** 40),
                 ("rms_norm_eps", -1.0), ("rope_parameters", {"rope_theta": float("inf"), "rope_type": "default"}),
                 ("num_hidden_layers", 2 ** 32 - 1), ("vocab_size", None), ("num_key_value_heads", 3)]


@pytest.mark.parametrize("field, value", BAD_HF_VALUES)
def test_hf_config_values_out_of_type_or_range_are_refused(tmp_path, hf_dir, field, value):
    path = tmp_path / "dir"
    shutil.copytree(hf_dir, path)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    assert not loads(path)
