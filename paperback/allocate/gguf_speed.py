"""How fast llama.cpp runs each GGUF type on this CPU, so that a fit is no slower than the recipe it replaces.

llama.cpp's CPU speed differs between types by more than their bytes: on x86 it repacks some types (Q4_0,
Q4_K, Q8_0, ...) into interleaved layouts its prompt matmuls run fast and reads the others row by row, and
which ones depends on its build and the CPU. So the speed of each candidate type is measured here, by
`llama-bench` itself, on files of the model's own shapes: one file per type and role, every weight of that
role the type tiles at that type and the rest at the reference type (Q8_0, which tiles every row of 32). The
weights are zeros: a quantized matmul's time does not depend on its values, and no quantization is needed.

The roles are llama.cpp's: the blocks' linears, token_embd and output. They are timed apart because one type
costs them differently: a prompt computes the output head for its last token only, the embedding is a lookup
unless tied to the head, and the embedding is not repacked where the same type is in the blocks (Gemma 3's
tied embedding holds most of its weights, so one cost per type would credit the blocks' speed to it).

A file's seconds per token (prompt processing and generation, each from its fastest run: the files take turns
for several rounds, so the machine's drift falls on all alike, and interference only ever slows a run) less
the reference file's, over the weights that changed type, is the cost per weight of the type in that role,
relative to the reference. A mix's time is then the reference's plus the sum of its tensors' costs: a linear
model a fit can hold to the recipe's own time as one more constraint of its exact solve, and then check by
timing the two whole (`time_files`). Tables are cached per CPU, llama-bench binary, threads and model shapes.
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
from paperback.quantization.model_pass import EMBED_PARAM, HEAD_PARAM

REFERENCE_TYPE = "Q8_0"
PHASES = ("prompt", "generate")
SPEED_ROLES = ("blocks", "token_embd", "output")  # llama.cpp's names for where a weight sits
SPEED_VERSION = 3


def speed_role(param: str) -> str:
    return {EMBED_PARAM: "token_embd", HEAD_PARAM: "output"}.get(param, "blocks")


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


def probe_types(kind: GGUFType, shapes: dict[str, tuple[int, int]], role: str | None = None
                ) -> dict[str, GGUFType]:
    """The probe file of `kind` (in `role`; every role where None): each such weight it tiles at `kind`, the
    rest at the reference type."""
    reference = GGUF_TYPES[REFERENCE_TYPE]
    return {p: kind if kind.can_tile(shape[1]) and role in (None, speed_role(p)) else reference
            for p, shape in shapes.items()}


def probes(kinds: tuple[GGUFType, ...], shapes: dict[str, tuple[int, int]]) -> dict[tuple[str, str], dict]:
    """{(type, role): probe types} for every role of the model a type tiles some weight of (the reference once,
    as (REFERENCE_TYPE, "all"))."""
    reference = GGUF_TYPES[REFERENCE_TYPE]
    files = {(REFERENCE_TYPE, "all"): probe_types(reference, shapes)}
    roles = sorted({speed_role(p) for p in shapes}, key=SPEED_ROLES.index)
    for kind in kinds:
        for role in roles:
            if kind.name != REFERENCE_TYPE and any(kind.can_tile(i) and speed_role(p) == role
                                                   for p, (_, i) in shapes.items()):
                files[kind.name, role] = probe_types(kind, shapes, role)
    return files


@dataclass
class SpeedTable:
    """{type: {role: {phase: seconds per token per weight, relative to the reference type}}} on one CPU."""
    costs: dict[str, dict[str, dict[str, float]]]
    reference_seconds: dict[str, float]  # seconds per token of the file all at the reference type
    measured: dict  # what was run: CPU, llama-bench, settings, each file's tokens/s per round

    def seconds(self, types: dict[str, GGUFType], shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
        """Predicted seconds per token of a file with `types`, each phase."""
        return {phase: self.reference_seconds[phase] + sum(self.cost(kind, phase, p) * shapes[p][0] * shapes[p][1]
                                                           for p, kind in types.items())
                for phase in PHASES}

    def cost(self, kind: GGUFType, phase: str, param: str) -> float:
        """Seconds per token per weight of `param` at `kind`, relative to the reference type."""
        if kind.name == REFERENCE_TYPE:
            return 0.0
        role = speed_role(param)
        if role not in self.costs.get(kind.name, {}):
            raise PaperbackError(f"{kind.name} has no measured speed in {role} (the table holds "
                                 f"{', '.join(f'{t} in {r}' for t, rs in self.costs.items() for r in rs)})")
        return self.costs[kind.name][role][phase]

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_signature() -> dict:
    """What a speed table holds for: the CPU's model name and its instruction set flags."""
    from paperback.system import read_cpuinfo

    model, flags = read_cpuinfo()
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


def time_files(llama_bench: Path, files: dict, settings: SpeedSettings) -> dict:
    """{name: [{phase: tokens/s} per round]}: each file once per round, in turn, for `settings.rounds` rounds."""
    runs: dict = {name: [] for name in files}
    for _ in range(settings.rounds):
        for name, path in files.items():
            runs[name].append(bench_once(llama_bench, path, settings))
    return runs


def seconds_per_token(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's fastest round, as seconds per token (interference only ever slows a run)."""
    return {phase: min(1 / run[phase] for run in runs) for phase in PHASES}


def time_assignments(lm, assignments: dict[str, dict[str, GGUFType]], llama_bench: Path,
                     settings: SpeedSettings = SpeedSettings()) -> dict:
    """Files of `lm`'s shapes with each of `assignments`' types (zeros) timed whole by llama-bench, in turns:
    {name: {"seconds": {phase: s per token}, "tokens_per_s": [per round]}}. Not cached: a fit's own check."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="paperback-speed-") as tmp:
        reader = gguf.GGUFReader(lm.source.path)
        files = {}
        for i, (name, types) in enumerate(assignments.items()):
            files[name] = Path(tmp) / f"{i}.gguf"
            write_probe(lm, types, files[name], reader)
        del reader
        runs = time_files(llama_bench, files, settings)
    return {name: {"seconds": seconds_per_token(r), "tokens_per_s": r} for name, r in runs.items()}


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
    planned = probes(tuple(GGUF_TYPES[n] for n in names), shapes)
    if progress:
        print(f"[fit gguf] measuring llama.cpp's speed of {len(names)} types in {len(planned)} files with "
              f"{llama_bench} ({settings.rounds} rounds, {settings.resolved_threads()} threads)", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="paperback-speed-") as tmp:
        reader = gguf.GGUFReader(lm.source.path)  # its metadata, parsed once for every file
        files = {}
        for (name, role), types in planned.items():
            files[name, role] = Path(tmp) / f"{name}-{role}.gguf"
            write_probe(lm, types, files[name, role], reader)
        del reader
        runs = time_files(llama_bench, files, settings)
    per_token = {file: seconds_per_token(r) for file, r in runs.items()}
    reference = per_token[REFERENCE_TYPE, "all"]
    costs: dict = {}
    for (name, role), types in planned.items():
        if name != REFERENCE_TYPE:
            changed = sum(shapes[p][0] * shapes[p][1] for p, kind in types.items() if kind.name == name)
            costs.setdefault(name, {})[role] = {ph: (per_token[name, role][ph] - reference[ph]) / changed
                                                for ph in PHASES}
    table = SpeedTable(costs, reference,
                       {**key_fields, "llama_bench_path": str(llama_bench),
                        "tokens_per_s": {f"{n} {r}": v for (n, r), v in runs.items()},
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
    numel: dict[str, dict[str, int]] = {}  # {role: {type: weights}}: what the file holds, in its metadata
    for p, kind in types.items():
        held = numel.setdefault(speed_role(p), {})
        held[kind.name] = held.get(kind.name, 0) + shapes[p][0] * shapes[p][1]
    write_weights(lm, weights, out, {"speed_probe": numel}, progress=False, reader=reader)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAPERBACK_CACHE", Path.home() / ".cache" / "paperback")) / "gguf-speed"
