"""The ``vllm`` backend's weight updates, prefix-cache check and seeded draws, on a fake engine.

vLLM cannot run here (no CUDA); :class:`FakeLLM` has the surface of ``vllm.LLM`` the backend
uses (``collective_rpc`` into a worker carrying :class:`VLLMWorkerExtension`, ``reset_prefix_cache``
returning a bool, ``generate`` with ``SamplingParams.extra_args`` and a Model Runner V2 style
logits-processor step: raw logits of a batch of rows -> processor -> vLLM's own random sampler).
The worker's model is the embedded HF model, so the draws are compared with the hf backend's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.backends import GenerationRequest, SamplingConfig
from node.backends.base import BackendError
from node.backends.hf import HFBackend
from node.backends.vllm import VLLMBackend, VLLMWorkerExtension
from node.backends.vllm_sampler import SeededDrawState
from node.backends.vllm_weights import (
    PrefixCacheBusy,
    StagingError,
    plan_chunks,
    reset_prefix_cache_checked,
    staging_candidates,
    staging_dir,
    staging_need,
)
from policy.model import CharTokenizer, ModelSpec, build_model

torch.set_num_threads(1)
TOK = CharTokenizer()
PROMPTS = ["abc", "a", "dcbadcba", "bd"]


@dataclass
class FakeSamplingParams:
    """The fields of ``vllm.SamplingParams`` the backend sets (top_k off = 0, as in vLLM 0.33)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None


class Runner:
    """``worker.model_runner``: ``get_model()`` returns a model with vLLM's ``load_weights``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: list[list[str]] = []  # names per load_weights call
        self.peak_alive = 0

    def get_model(self) -> Any:
        runner = self

        class Loader:
            def parameters(self) -> Iterator[torch.nn.Parameter]:
                return runner.model.parameters()

            def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
                params = dict(runner.model.named_parameters(remove_duplicate=False))
                names = []
                for name, tensor in weights:  # one tensor at a time, as a generator hands it
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    names.append(name)
                    runner.peak_alive = max(runner.peak_alive, 1)
                runner.loaded.append(names)
                return set(names)

        return Loader()


class FakeLLM:
    """The surface of ``vllm.LLM`` the backend uses; ``resets`` scripts reset_prefix_cache()."""

    def __init__(self, model: torch.nn.Module, resets: Iterable[bool] = ()) -> None:
        self.model = model.eval()
        self.worker = type("Worker", (VLLMWorkerExtension,), {})()
        self.worker.model_runner = Runner(self.model)
        self.resets = iter(resets)
        self.reset_calls = 0
        self.staged: list[tuple[str, int]] = []  # (directory, bytes) of each staged file
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))

    def reset_prefix_cache(self) -> bool:
        self.reset_calls += 1
        return next(self.resets, True)

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "rollout_swarm_load_file":
            self.staged.append((os.path.dirname(args[0]), os.path.getsize(args[0])))
        fn = getattr(self.worker, method) if isinstance(method, str) else method
        return [fn(*args)] if isinstance(method, str) else [fn(self.worker, *args)]

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool) -> list:
        """Lock-step decoding of every request: one logits row each per step through the
        processor (Model Runner V2 order), then a random draw from the processed row."""
        proc = SeededDrawState()
        seqs = [list(p["prompt_token_ids"]) for p in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        reason = ["length"] * len(prompts)
        for slot, p in enumerate(params):
            proc.add(slot, p.extra_args)
        rng = torch.Generator().manual_seed(1234)  # vLLM's own RNG: must not matter
        while not all(done):
            live = [i for i in range(len(prompts)) if not done[i]]
            rows = torch.stack([self.model(torch.tensor([seqs[i]])).logits[0, -1] for i in live])
            rows = proc.apply(rows.float(), live, [len(seqs[i]) - 1 for i in live])
            for r, i in enumerate(live):
                probs = torch.softmax(rows[r] / params[i].temperature, -1)
                tok = int(torch.multinomial(probs, 1, generator=rng))
                seqs[i].append(tok)
                outs[i].append(tok)
                if tok in params[i].stop_token_ids:
                    done[i], reason[i] = True, "stop"
                elif len(outs[i]) == params[i].max_tokens:
                    done[i] = True
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=o, finish_reason=w, logprobs=None)])
            for o, w in zip(outs, reason, strict=True)
        ]


def make(llm: FakeLLM, **opts: Any) -> VLLMBackend:
    b = VLLMBackend.__new__(VLLMBackend)
    b._configure(
        ModelSpec(),
        opts.get("staging_dir"),
        opts.get("update_chunk_bytes", 1 << 20),
        opts.get("reset_timeout_s", 0.2),
    )
    b.vocab_size = TOK.vocab_size
    b.eos_token_ids = (TOK.eos_token_id,)
    b.loaded_version = None
    b.processed_logprobs = True
    b._extension = True
    b.seeded_draws = True
    b._adopt_engine(llm, FakeSamplingParams)
    return b


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    """A new version of the embedded model (tied weights stay tied, as in a real checkpoint)."""
    model = build_model(ModelSpec())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return {k: v.detach() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------- draws
@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=10),
        SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=10),
        SamplingConfig(temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=10),
    ],
    ids=["plain", "t0.7-p0.9", "t1.3-k5-p0.8"],
)
def test_seeded_draws_match_the_hf_backend(cfg: SamplingConfig) -> None:
    """Same model, seeds and settings: the vLLM path's tokens are the hf backend's and its
    behaviour log-probs match (different forward shapes: fp32 rounding only)."""
    model = build_model(ModelSpec())
    reqs = [GenerationRequest(TOK.encode_prompt(p), 2, seed=10 + i) for i, p in enumerate(PROMPTS)]
    want = HFBackend(ModelSpec(), device="cpu", model=model).generate(reqs, cfg)
    got = make(FakeLLM(model)).generate(reqs, cfg)
    for wg, gg in zip(want, got, strict=True):
        for w, g in zip(wg, gg, strict=True):
            assert g.token_ids == w.token_ids
            assert g.finish_reason == w.finish_reason
            # fp32 logits of a cached batched forward vs a fresh one differ by ~1e-6
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_processor_leaves_foreign_and_prefill_rows_alone() -> None:
    state = SeededDrawState()
    extra = {
        "rollout_swarm_draw": {
            "tag": "t",
            "seed": 5,
            "prompt_len": 4,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
        }
    }
    assert state.add(0, extra) and not state.add(1, None)
    logits = torch.randn(3, 8)
    before = logits.clone()
    # row 0: slot 0 mid-prefill (pos 1 < prompt_len - 1); row 1: a foreign slot; row 2: slot 0 t=0
    state.apply(logits, [0, 1, 0], [1, 7, 3])
    assert torch.equal(logits[:2], before[:2])
    assert int((logits[2] == 0).sum()) == 1 and int(torch.isinf(logits[2]).sum()) == 7
    assert [t for t, _ in state.draws.drain(["t"])["t"]] == [int(logits[2].argmax())]
    with pytest.raises(ValueError, match="malformed"):
        state.add(2, {"rollout_swarm_draw": {"tag": "x"}})


def test_tokens_that_disagree_with_the_draws_are_refused() -> None:
    class Skips(FakeLLM):  # an engine where the processor is not loaded
        def generate(
            self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool
        ) -> list:
            for p in params:
                p.extra_args = None
            return super().generate(prompts, params, use_tqdm)

    b = make(Skips(build_model(ModelSpec())))
    with pytest.raises(BackendError, match="disagree with the seeded draws"):
        b.generate([GenerationRequest(TOK.encode_prompt("ab"), 1, seed=1)], SamplingConfig())


# ------------------------------------------------------------------------------- weights
def test_update_streams_in_bounded_chunks_and_swaps_weights(tmp_path: Path) -> None:
    llm = FakeLLM(build_model(ModelSpec()))
    b = make(llm, staging_dir=str(tmp_path), update_chunk_bytes=64 << 10)
    new = perturbed(1)
    b.load_state_dict(3, new)
    assert b.loaded_version == 3
    sizes = {k: v.numel() * v.element_size() for k, v in new.items()}
    assert b.last_update is not None and b.last_update.chunks == len(llm.staged) > 1
    for (where, nbytes), names in zip(llm.staged, llm.worker.model_runner.loaded, strict=True):
        assert where == str(tmp_path)
        assert len(names) == 1 or sum(sizes[n] for n in names) <= 64 << 10
        assert nbytes < sum(sizes[n] for n in names) + 4096  # the chunk's tensors + a header
    assert sorted(n for names in llm.worker.model_runner.loaded for n in names) == sorted(new)
    for name, p in llm.model.named_parameters():
        assert torch.equal(p.detach(), new[name]), name
    assert not list(tmp_path.iterdir()), "staged files are removed"


def test_delta_update_sends_only_the_changed_tensors(tmp_path: Path) -> None:
    llm = FakeLLM(build_model(ModelSpec()))
    b = make(llm, staging_dir=str(tmp_path))
    b.load_state_dict(1, perturbed(1))
    llm.worker.model_runner.loaded.clear()
    v2 = perturbed(1)
    changed = sorted(n for n in v2 if ".layers.0." in n)[:2]
    for name in changed:
        v2[name] = v2[name] + 1.0
    b.load_state_dict(2, v2, changed=changed)
    assert [n for names in llm.worker.model_runner.loaded for n in names] == changed
    params = dict(llm.model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(params[n].detach(), v2[n]) for n in changed)
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        b.load_state_dict(3, {}, changed=["nope"])


def test_prefix_cache_reset_is_retried_until_it_succeeds(tmp_path: Path) -> None:
    llm = FakeLLM(build_model(ModelSpec()), resets=[False, False, True])
    b = make(llm, staging_dir=str(tmp_path), reset_timeout_s=5.0)
    b.load_state_dict(1, perturbed(1))
    assert b.loaded_version == 1 and llm.reset_calls == 4  # 3 before the update, 1 after


def test_busy_prefix_cache_refuses_the_version_and_keeps_the_old(tmp_path: Path) -> None:
    llm = FakeLLM(build_model(ModelSpec()))
    b = make(llm, staging_dir=str(tmp_path), reset_timeout_s=0.05)
    b.load_state_dict(1, perturbed(1))
    old = {k: v.detach().clone() for k, v in llm.model.named_parameters()}
    llm.resets = iter([False] * 1000)
    with pytest.raises(PrefixCacheBusy, match="refused and the old one kept"):
        b.load_state_dict(2, perturbed(2))
    assert b.loaded_version == 1
    assert all(torch.equal(p.detach(), old[k]) for k, p in llm.model.named_parameters())


def test_a_reset_that_fails_after_the_update_unsets_the_version(tmp_path: Path) -> None:
    llm = FakeLLM(build_model(ModelSpec()), resets=[True] + [False] * 1000)
    b = make(llm, staging_dir=str(tmp_path), reset_timeout_s=0.05)
    with pytest.raises(PrefixCacheBusy):
        b.load_state_dict(1, perturbed(1))
    assert b.loaded_version is None  # weights moved but unconfirmed: the node reloads in full


def test_no_staging_room_refuses_the_version_and_keeps_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    llm = FakeLLM(build_model(ModelSpec()))
    b = make(llm, staging_dir=str(tmp_path))
    b.load_state_dict(1, perturbed(1))
    old = {k: v.detach().clone() for k, v in llm.model.named_parameters()}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(BackendError, match=r"no room to stage .* has 1\.0 MiB free"):
        b.load_state_dict(2, perturbed(2))
    assert b.loaded_version == 1
    assert all(torch.equal(p.detach(), old[k]) for k, p in llm.model.named_parameters())


def test_staging_falls_back_from_a_small_shm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    disk.mkdir()
    real = shutil.disk_usage
    free = {str(shm): 64 << 20, str(disk): 10 << 30}  # a default Docker /dev/shm: 64 MiB
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free[str(p)]))
    assert staging_dir(1 << 20, [shm, disk]) == shm
    assert staging_dir(100 << 20, [shm, disk]) == disk
    with pytest.raises(StagingError, match=r"shm has 64\.0 MiB free; .*disk has 10240\.0 MiB"):
        staging_dir(20 << 30, [shm, disk])
    monkeypatch.setenv("ROLLOUT_SWARM_STAGING_DIR", str(disk))
    assert staging_candidates() == [disk]
    assert staging_candidates(str(shm)) == [shm]


def test_chunks_cast_to_the_engine_dtype_and_untie_shared_storage() -> None:
    w = torch.randn(4, 4)
    sd = {"a": w, "b": w, "c": torch.randn(300, 300), "step": torch.tensor([3])}
    chunks = list(plan_chunks(sd, None, dtype="bfloat16", chunk_bytes=1024))
    assert [sorted(c) for c in chunks] == [["a", "b"], ["c"], ["step"]]
    assert chunks[0]["a"].dtype == torch.bfloat16 and chunks[2]["step"].dtype == torch.int64
    a, b = chunks[0]["a"], chunks[0]["b"]
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert staging_need(sd, None, dtype="bfloat16", chunk_bytes=1024) == 300 * 300 * 2
    assert staging_need(sd, ["a"], dtype="bfloat16", chunk_bytes=1024) == 32


def test_reset_waits_are_bounded_and_grow() -> None:
    waits: list[float] = []
    now = [0.0]

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    with pytest.raises(PrefixCacheBusy):
        reset_prefix_cache_checked(lambda: False, timeout_s=2.0, sleep=sleep, clock=lambda: now[0])
    assert now[0] <= 2.0 and waits[:3] == [0.01, 0.02, 0.04] and max(waits) == 0.5
    with pytest.raises(PrefixCacheBusy, match="not a bool"):
        reset_prefix_cache_checked(lambda: None)
