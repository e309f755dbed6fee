"""Capability probe: sane hardware values, benchmark, cache, advert mapping."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from node.backends.fake import FakeBackend
from node.backends.hf import HFBackend
from node.probe import probe, probe_hardware, self_benchmark
from policy.model import ModelSpec

torch.set_num_threads(1)


def test_hardware_is_sane() -> None:
    hw = probe_hardware()
    assert hw.cpu.cores >= 1
    assert hw.cpu.memory_bytes > 1 << 26  # Linux /proc/meminfo: more than 64 MiB
    assert hw.cpu.torch_threads == torch.get_num_threads()
    assert hw.fingerprint.startswith("sha256:") and hw.fingerprint == probe_hardware().fingerprint
    if torch.cuda.is_available():
        assert sum(g.count for g in hw.gpus) == torch.cuda.device_count()
        assert all(g.memory_bytes > 0 and "." in g.compute_capability for g in hw.gpus)
    else:
        assert hw.gpus == []


def test_benchmark_hf_measures_throughput() -> None:
    bench = self_benchmark(HFBackend(ModelSpec(), device="cpu"), budget_s=0.2)
    assert bench.backend == "hf"
    assert bench.tokens_per_s > 0 and bench.rollouts_per_s > 0
    assert bench.tokens_per_s >= bench.rollouts_per_s  # every sample has >= 1 token
    assert 0 < bench.seconds < 5


def test_probe_caches_benchmark(tmp_path: Path) -> None:
    backend = FakeBackend()
    first = probe(backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m1")
    assert not first.cached
    files = list(tmp_path.glob("probe-fake-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["bench"]["backend"] == "fake"

    backend.generate_calls = 0
    start = time.perf_counter()
    second = probe(backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m1")
    assert second.cached and second.bench == first.bench
    assert backend.generate_calls == 0  # no benchmark ran
    assert time.perf_counter() - start < 1.0

    other_model = probe(backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m2")
    assert not other_model.cached
    refreshed = probe(
        backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m1", refresh=True
    )
    assert not refreshed.cached
    stale = probe(
        backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m1", max_age_s=0.0
    )
    assert not stale.cached
    files[0].write_text("{not json")
    assert not probe(backend, ModelSpec(), cache_dir=tmp_path, budget_s=0.05, model_fp="m1").cached


def test_advert_fields_build_a_capability_advert(tmp_path: Path) -> None:
    from protocol.messages import CapabilityAdvert

    cap = probe(FakeBackend(), ModelSpec(), cache_dir=tmp_path, budget_s=0.05)
    advert = CapabilityAdvert(
        peer_id="QmPeer",
        node_key=b"k" * 32,
        price_per_hour=None,
        policy_version=None,
        reachability="unknown",
        software_version="0.1.0",
        expires_at=time.time() + 60,
        **cap.to_advert_fields(),
    )
    assert advert.backend == "fake" and advert.tokens_per_s > 0
    assert advert.cpu is not None and advert.cpu.cores == cap.hardware.cpu.cores
