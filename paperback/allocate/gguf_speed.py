"""How fast llama.cpp runs each GGUF type on this CPU, so that a fit is no slower than the recipe it replaces.

llama.cpp's CPU speed differs between types by more than their bytes: on x86 it repacks some types (Q4_0,
Q4_K, Q8_0, ...) into interleaved layouts its prompt matmuls run fast and reads the others row by row, and
which ones depends on its build and the CPU. So the speed of each candidate type is measured here, by
`llama-bench` itself, on files of the model's own shapes: one file per type, every weight that type tiles
at that type and the rest at the reference type (Q8_0, which tiles every row of 32). The weights are zeros:
a quantized matmul's time does not depend on its values, and no quantization is needed to write them.

A file's seconds per token (prompt processing and generation, each from its fastest run: the files take turns
for several rounds, so the machine's drift falls on all alike, and interference only ever slows a run) less
the reference file's, over the weights that changed type, is the type's cost per weight relative to the
reference. A mix's time is then the reference's
plus the sum of its tensors' costs: a linear model a fit can hold to the recipe's own time as one more
constraint of its exact solve. Tables are cached per CPU, llama-bench binary, threads and model shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_types import GGUF_TYPES, GGUFType
from paperback.quantization.gguf_weight import GGUFWeight

REFERENCE_TYPE = "Q8_0"
PHASES = ("prompt", "generate")
SPEED_VERSION = 2


@dataclass(frozen=True)
class SpeedSettings:
    prompt: int = 512  # llama-bench -p: tokens of prompt processing
    generate: int = 128  # llama-bench -n: tokens generated
    rounds: int = 3  # every file once per round ...
    repetitions: int = 2  # ... and run this many times in a round (after llama-bench's warm-up)
    threads: int = 0  # llama-bench -t; 0: the CPUs this process may run on

    def resolved_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


def find_llama_bench(path: str | Path | None) -> Path | None:
    """llama-bench at `path`, else on PATH; None where neither is (a given path that is not one is refused)."""
    if path is not None:
        path = Path(path)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PaperbackError(f"--llama-bench {path} is not an executable file")
        return path
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def zero_weight(kind: GGUFType, shape: tuple[int, int]) -> GGUFWeight:
    """A `shape` weight of `kind` whose every value is zero (codes at the type's zero, scales zero)."""
    out_features, in_features = shape
    if kind.is_float:
        return GGUFWeight(kind, shape, values=torch.zeros(shape))
    supers = in_features // kind.block_size
    subs = in_features // kind.sub_block
    return GGUFWeight(kind, shape, codes=torch.zeros(shape, dtype=torch.uint8), d=torch.zeros(out_features, supers),
                      dmin=torch.zeros(out_features, supers) if kind.has_min else None,
                      scales=torch.ones(out_features, subs, dtype=torch.int16),
                      mins=torch.zeros(out_features, subs, dtype=torch.int16) if kind.has_min else None)


def probe_types(kind: GGUFType, shapes: dict[str, tuple[int, int]]) -> dict[str, GGUFType]:
    """The probe file of `kind`: every weight it tiles at `kind`, the rest at the reference type."""
    reference = GGUF_TYPES[REFERENCE_TYPE]
    return {p: kind if kind.can_tile(shape[1]) else reference for p, shape in shapes.items()}


@dataclass
class SpeedTable:
    """{type: {phase: seconds per token per weight, relative to the reference type}} on one CPU."""
    costs: dict[str, dict[str, float]]
    reference_seconds: dict[str, float]  # seconds per token of the file all at the reference type
    measured: dict  # what was run: CPU, llama-bench, settings, each file's tokens/s per round

    def seconds(self, types: dict[str, GGUFType], shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
        """Predicted seconds per token of a file with `types`, each phase."""
        return {phase: self.reference_seconds[phase] + sum(self.cost(kind, phase) * shapes[p][0] * shapes[p][1]
                                                           for p, kind in types.items())
                for phase in PHASES}

    def cost(self, kind: GGUFType, phase: str) -> float:
        if kind.name not in self.costs:
            raise PaperbackError(f"{kind.name} has no measured speed (the table holds {', '.join(self.costs)})")
        return self.costs[kind.name][phase]

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_signature() -> dict:
    """What a speed table holds for: the CPU's model name and its instruction set flags."""
    model, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return {"model": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def _binary_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def bench_once(llama_bench: Path, model: Path, settings: SpeedSettings) -> dict[str, float]:
    """{phase: tokens/s of the fastest repetition} of one llama-bench call."""
    argv = [str(llama_bench), "-m", str(model), "-p", str(settings.prompt), "-n", str(settings.generate),
            "-t", str(settings.resolved_threads()), "-r", str(settings.repetitions), "-o", "json"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise PaperbackError(f"{llama_bench} failed on a file of the model's shapes (exit {proc.returncode}): "
                             f"{said[-1] if said else 'it printed nothing'}")
    try:
        tests = json.loads(proc.stdout[proc.stdout.index("["):])
    except ValueError as error:
        raise PaperbackError(f"llama-bench printed no JSON for {model.name}: {error}") from None
    found = {}
    for test in tests:
        found["prompt" if test["n_prompt"] else "generate"] = float(max(test.get("samples_ts") or [test["avg_ts"]]))
    if set(found) != set(PHASES):
        raise PaperbackError(f"llama-bench reported {sorted(found)} for {model.name}, not prompt and generation")
    return found


def measure_speed(lm, kinds: tuple[GGUFType, ...], llama_bench: Path, settings: SpeedSettings = SpeedSettings(),
                  cache_dir: Path | None = None, progress: bool = True) -> SpeedTable:
    """The speed table of `kinds` for the model of `lm` (a LoadedModel from a GGUF file), measured or cached."""
    import gguf

    from paperback.export.gguf_quantize import weight_shapes

    shapes = weight_shapes(lm.config)
    names = sorted({k.name for k in kinds} | {REFERENCE_TYPE}, key=list(GGUF_TYPES).index)
    key_fields = {"version": SPEED_VERSION, "cpu": cpu_signature(), "llama_bench": _binary_digest(llama_bench),
                  "settings": {**asdict(settings), "threads": settings.resolved_threads()},
                  "shapes": sorted(shapes.items()), "family": lm.config.family, "types": names}
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True, default=str).encode()).hexdigest()[:24]
    cache = (cache_dir or default_cache_dir()) / f"{key}.json"
    if cache.is_file():
        if progress:
            print(f"[fit gguf] llama.cpp's speed per type from {cache}", flush=True)
        return SpeedTable(**json.loads(cache.read_text()))
    if progress:
        print(f"[fit gguf] measuring llama.cpp's speed of {len(names)} types with {llama_bench} "
              f"({settings.rounds} rounds, {settings.resolved_threads()} threads)", flush=True)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="paperback-speed-") as tmp:
        reader = gguf.GGUFReader(lm.source.path)  # its metadata, parsed once for every file
        files = {}
        for name in names:
            files[name] = Path(tmp) / f"{name}.gguf"
            write_probe(lm, probe_types(GGUF_TYPES[name], shapes), files[name], reader)
        del reader
        for _ in range(settings.rounds):
            for name in names:
                runs[name].append(bench_once(llama_bench, files[name], settings))
    per_token = {n: {ph: min(1 / r[ph] for r in runs[n]) for ph in PHASES} for n in names}
    costs = {}
    for name in names:
        changed = sum(o * i for p, (o, i) in shapes.items() if GGUF_TYPES[name].can_tile(i))
        costs[name] = {ph: 0.0 if name == REFERENCE_TYPE else
                       (per_token[name][ph] - per_token[REFERENCE_TYPE][ph]) / changed for ph in PHASES}
    table = SpeedTable(costs, per_token[REFERENCE_TYPE],
                       {**key_fields, "llama_bench_path": str(llama_bench), "tokens_per_s": runs,
                        "seconds": time.perf_counter() - t0})
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp_file.write_text(json.dumps(table.to_dict(), default=str))
    os.replace(tmp_file, cache)
    return table


def write_probe(lm, types: dict[str, GGUFType], out: Path, reader=None) -> None:
    """A GGUF file of `lm`'s shapes and metadata whose weights are zeros of `types` (its norms its own)."""
    from paperback.export.gguf_quantize import weight_shapes, write_weights

    shapes = weight_shapes(lm.config)
    weights = {p: zero_weight(kind, shapes[p]) for p, kind in types.items()}
    numel: dict[str, int] = {}
    for p, kind in types.items():
        numel[kind.name] = numel.get(kind.name, 0) + shapes[p][0] * shapes[p][1]
    write_weights(lm, weights, out, {"speed_probe": numel}, progress=False, reader=reader)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAPERBACK_CACHE", Path.home() / ".cache" / "paperback")) / "gguf-speed"
