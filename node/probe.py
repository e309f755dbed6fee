"""Capability probe: what hardware this node has and how fast its backend generates.

- :func:`probe_hardware` — GPUs via ``torch.cuda`` (name, memory, compute capability; identical
  GPUs grouped with a count) and the CPU (usable cores from ``os.sched_getaffinity``, memory
  from ``/proc/meminfo``).
- :func:`self_benchmark` — a short run (about ``budget_s`` seconds) of the chosen backend on a
  small fixed batch of the current policy: generated tokens/s and completed samples/s.
- :func:`probe` — both, with the benchmark cached as JSON in ``cache_dir`` under a key of
  (backend, model fingerprint, hardware fingerprint), so a restart skips the benchmark.

Results are plain dataclasses; :meth:`Capability.to_advert_fields` maps them onto the fields of
``protocol.messages.CapabilityAdvert`` (the node adds peer id, key, price, version, expiry).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.backends.base import GenerationRequest, InferenceBackend, SamplingConfig

if TYPE_CHECKING:
    from policy.model import ModelSpec

log = logging.getLogger(__name__)

CACHE_FORMAT = 1


@dataclass(frozen=True)
class GpuProbe:
    """A kind of GPU present on this host (identical devices grouped)."""

    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # total memory per device, bytes
    compute_capability: str  # "major.minor", e.g. "9.0"
    count: int  # devices of this kind


@dataclass(frozen=True)
class CpuProbe:
    """The host CPU and memory."""

    cores: int  # logical cores this process may run on (sched_getaffinity)
    memory_bytes: int  # total host memory, bytes (0 when unknown)
    model_name: str  # CPU model string ("" when unknown)
    torch_threads: int  # torch intra-op threads of this process


@dataclass(frozen=True)
class HardwareInfo:
    gpus: list[GpuProbe]
    cpu: CpuProbe
    fingerprint: str  # stable hash of the above plus torch version


@dataclass(frozen=True)
class BenchResult:
    """Measured throughput of a backend on the probe batch."""

    backend: str
    tokens_per_s: float  # generated tokens (EOS included) per wall-clock second
    rollouts_per_s: float  # completed samples per wall-clock second
    prompts: int  # prompts per generate call
    samples_per_prompt: int  # n per prompt
    max_new_tokens: int
    seconds: float  # measured wall time (warm-up excluded)
    measured_at: float  # Unix seconds


@dataclass(frozen=True)
class Capability:
    """Everything the node advertises about itself."""

    hardware: HardwareInfo
    backend: str
    dtype: str
    bench: BenchResult
    model_fingerprint: str
    cached: bool = field(default=False)  # bench came from the cache

    def to_advert_fields(self) -> dict[str, Any]:
        """Keyword arguments for ``protocol.messages.CapabilityAdvert`` (gpus, cpu, backend,
        dtype, tokens_per_s, rollouts_per_s)."""
        from protocol.messages import CpuInfo, GpuInfo

        return {
            "gpus": [
                GpuInfo(
                    name=g.name[:128],
                    memory_bytes=g.memory_bytes,
                    compute_capability=g.compute_capability,
                    count=g.count,
                )
                for g in self.hardware.gpus
            ],
            "cpu": CpuInfo(
                cores=self.hardware.cpu.cores, memory_bytes=self.hardware.cpu.memory_bytes
            ),
            "backend": self.backend,
            "dtype": self.dtype,
            "tokens_per_s": float(self.bench.tokens_per_s),
            "rollouts_per_s": float(self.bench.rollouts_per_s),
        }


# ---------------------------------------------------------------------------- hardware
def _meminfo_bytes(path: str = "/proc/meminfo") -> int:
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS / Windows
        return os.cpu_count() or 1


def probe_gpus() -> list[GpuProbe]:
    """CUDA devices grouped by (name, memory, capability); empty without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return []
    if not torch.cuda.is_available():
        return []
    kinds: Counter[tuple[str, int, str]] = Counter()
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        kinds[(props.name, int(props.total_memory), f"{props.major}.{props.minor}")] += 1
    return [GpuProbe(n, m, c, count) for (n, m, c), count in sorted(kinds.items())]


def probe_hardware() -> HardwareInfo:
    import torch

    gpus = probe_gpus()
    cpu = CpuProbe(
        cores=_usable_cores(),
        memory_bytes=_meminfo_bytes(),
        model_name=_cpu_model(),
        torch_threads=torch.get_num_threads(),
    )
    blob = json.dumps(
        {"gpus": [asdict(g) for g in gpus], "cpu": asdict(cpu), "torch": torch.__version__},
        sort_keys=True,
    ).encode()
    return HardwareInfo(gpus, cpu, "sha256:" + hashlib.sha256(blob).hexdigest())


def model_fingerprint(spec: ModelSpec) -> str:
    """Throughput-relevant identity of the policy: architecture config hash + dtype (weights
    versions do not change speed)."""
    from policy.model import config_fingerprint, load_config

    return f"{config_fingerprint(load_config(spec))}/{spec.dtype}"


# ---------------------------------------------------------------------------- benchmark
def _bench_requests(backend: InferenceBackend, prompts: int, n: int, seed: int) -> list[Any]:
    vocab = max(backend.vocab_size, 2)
    stops = set(backend.eos_token_ids)
    out = []
    for i in range(prompts):
        toks = [(3 + 5 * i + 7 * j) % vocab for j in range(6 + i % 3)]
        toks = [t if t not in stops else (t + 1) % vocab for t in toks]
        out.append(GenerationRequest(toks, n, seed=seed * 1000 + i))
    return out


def self_benchmark(
    backend: InferenceBackend,
    *,
    budget_s: float = 1.5,
    prompts: int = 8,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 16,
) -> BenchResult:
    """Throughput of ``backend`` on a fixed batch: one warm-up call, then repeated calls until
    about ``budget_s`` seconds are spent (at least one timed call)."""
    limit = int(getattr(backend, "max_positions", 0) or getattr(backend, "max_model_len", 0) or 0)
    if limit:
        max_new_tokens = max(1, min(max_new_tokens, limit - 9))
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    backend.generate(_bench_requests(backend, prompts, samples_per_prompt, 0), sampling)
    deadline = t0 + budget_s
    tokens = samples = 0
    timed = 0.0
    rnd = 1
    while rnd == 1 or time.perf_counter() < deadline:
        start = time.perf_counter()
        out = backend.generate(_bench_requests(backend, prompts, samples_per_prompt, rnd), sampling)
        timed += time.perf_counter() - start
        tokens += sum(len(s.token_ids) for group in out for s in group)
        samples += sum(len(group) for group in out)
        rnd += 1
    timed = max(timed, 1e-9)
    return BenchResult(
        backend=backend.name,
        tokens_per_s=tokens / timed,
        rollouts_per_s=samples / timed,
        prompts=prompts,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        seconds=timed,
        measured_at=time.time(),
    )


# ---------------------------------------------------------------------------- probe + cache
def _cache_path(cache_dir: Path, backend: str, model_fp: str, hw_fp: str) -> Path:
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{backend}\0{model_fp}\0{hw_fp}".encode()).hexdigest()
    return cache_dir / f"probe-{backend}-{key[:24]}.json"


def _load_cached(path: Path, max_age_s: float) -> BenchResult | None:
    try:
        data = json.loads(path.read_text())
        bench = BenchResult(**data["bench"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if time.time() - bench.measured_at > max_age_s:
        return None
    return bench


def probe(
    backend: InferenceBackend,
    spec: ModelSpec,
    *,
    cache_dir: Path | str | None = None,
    budget_s: float = 1.5,
    max_age_s: float = 7 * 24 * 3600.0,
    refresh: bool = False,
    model_fp: str | None = None,
) -> Capability:
    """Hardware + backend throughput. With ``cache_dir`` the benchmark is read from / written
    to ``cache_dir/probe-<backend>-<key>.json`` (key: backend, model and hardware fingerprints);
    ``refresh=True`` or an entry older than ``max_age_s`` re-measures. ``model_fp`` overrides
    :func:`model_fingerprint` (which imports transformers)."""
    hardware = probe_hardware()
    model_fp = model_fp or model_fingerprint(spec)
    path = (
        _cache_path(Path(cache_dir), backend.name, model_fp, hardware.fingerprint)
        if cache_dir is not None
        else None
    )
    if path is not None and not refresh:
        cached = _load_cached(path, max_age_s)
        if cached is not None:
            log.info("probe: using cached benchmark %s", path)
            return Capability(hardware, backend.name, backend.dtype, cached, model_fp, cached=True)
    log.info("probe: benchmarking backend %s for about %.1f s", backend.name, budget_s)
    bench = self_benchmark(backend, budget_s=budget_s)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "bench": asdict(bench)}, indent=1))
        os.replace(tmp, path)
    return Capability(hardware, backend.name, backend.dtype, bench, model_fp, cached=False)
