"""The stop set: the coordinator's, carried by every lease, used exactly by nodes and intake.

Instruct models list several EOS ids in ``generation_config.json`` (``[<|im_end|>,
<|endoftext|>]``). Before the lease carried the stop set, nodes stopped on the union of the config
and generation-config EOS ids while the intake accepted only the tokenizer's EOS: every honest
sample ending on the second id was refused (``bad_termination``) and the node struck and banned.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from coord_harness import advert, config

from coordinator.arith import ArithmeticTask
from coordinator.core import Coordinator
from coordinator.store import Store
from node.backends.fake import FakeBackend
from node.rollouts import build_submission, lease_requests, to_sampling_config
from policy.model import ModelSpec, load_tokenizer, model_stop_ids
from policy.prompts import PromptRenderer
from policy.testing import build_tiny_chat_model
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import (
    Ack,
    GroupResult,
    Lease,
    LeaseRequest,
    Reject,
    Sample,
    Timings,
    pack_tokens,
)

PUBLISHER = Identity.generate()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


def _coordinator(tmp_path: Path, model_dir: Path) -> Coordinator:
    spec = ModelSpec(path=str(model_dir))
    tok = load_tokenizer(spec)
    cfg = config(tmp_path, task="arith", sampling={"max_new_tokens": 6})
    core = Coordinator(
        cfg,
        store=Store(cfg.db_path),
        task=ArithmeticTask(),
        tokenizer=tok,
        prompts=PromptRenderer(tok),
        stop_token_ids=model_stop_ids(spec, tok),
        publisher_key=PUBLISHER.public_key,
    )
    manifest, _ = build_manifest(
        {"model.safetensors": b"w" * 64}, version=1, parent_version=None, model_config_hash="ab",
        tokenizer_hash="cd", created_at=core.clock(), expires_at=core.clock() + 86400,
        chunk_size=32,
    )  # fmt: skip
    core.publish_version(sign_manifest(manifest, PUBLISHER, core.clock()))
    return core


def register_node(core: Coordinator) -> Identity:
    """A node registered with the fake backend (what its submissions then name)."""
    ident = Identity.generate()
    core.register(ident.public_key, advert(ident, core.clock(), backend="fake"))
    return ident


def test_stop_set_unites_tokenizer_config_and_generation_config(model_dir: Path) -> None:
    spec = ModelSpec(path=str(model_dir))
    tok = load_tokenizer(spec)
    im_end, endoftext = tok.encode("<|im_end|>"), tok.encode("<|endoftext|>")
    assert tok.eos_token_id == im_end[0]
    assert model_stop_ids(spec, tok) == tuple(sorted({im_end[0], endoftext[0]}))
    assert model_stop_ids(ModelSpec()) == (2,)  # the embedded model: its one EOS


def test_embedded_figures_match_its_config_without_importing_it() -> None:
    """swarm demo checks the embedded set-up without importing transformers; the constants it
    uses must be the config's."""
    from policy.model import max_positions, model_vocab_size, tiny_config

    config = tiny_config()
    assert max_positions(ModelSpec()) == config.max_position_embeddings
    assert model_vocab_size(ModelSpec()) == config.vocab_size
    assert model_stop_ids(ModelSpec()) == (config.eos_token_id,)


def test_honest_samples_ending_on_any_eos_are_accepted(tmp_path: Path, model_dir: Path) -> None:
    core = _coordinator(tmp_path, model_dir)
    try:
        tok = core.tokenizer
        endoftext = tok.encode("<|endoftext|>")[0]
        node = register_node(core)
        lease = core.request_lease(node.public_key, _lease_request())
        assert isinstance(lease, Lease)
        # the lease names the whole stop set; the node uses exactly it
        assert set(lease.sampling.stop_token_ids) == {endoftext, tok.eos_token_id}
        sampling = to_sampling_config(lease)
        backend = FakeBackend(ModelSpec(path=str(model_dir)), eos_token_id=endoftext)
        assert backend.stop_set(sampling) == frozenset(lease.sampling.stop_token_ids)
        requests = lease_requests(lease)
        outs = backend.generate(requests, sampling)
        ends = [s.token_ids[-1] for group in outs for s in group if s.finish_reason == "stop"]
        assert endoftext in ends  # samples end on the *second* EOS id
        sub = build_submission(
            lease, requests, outs, set(backend.eos_token_ids), backend="fake", dtype="float32",
            timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
        )  # fmt: skip
        verdict = _run(core.submit(node.public_key, sub))
        assert isinstance(verdict, Ack), verdict
    finally:
        core.close()


def test_tokens_after_a_stop_token_are_still_refused(tmp_path: Path, model_dir: Path) -> None:
    core = _coordinator(tmp_path, model_dir)
    try:
        endoftext = core.tokenizer.encode("<|endoftext|>")[0]
        node = register_node(core)
        lease = core.request_lease(node.public_key, _lease_request())
        assert isinstance(lease, Lease)
        backend = FakeBackend(ModelSpec(path=str(model_dir)), eos_token_id=endoftext)
        requests = lease_requests(lease)
        sub = build_submission(
            lease, requests, backend.generate(requests, to_sampling_config(lease)),
            set(backend.eos_token_ids), backend="fake", dtype="float32",
            timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
        )  # fmt: skip
        body = [5, 6]
        bad = [[*body, endoftext, 7], [*body, 99]]  # continues after EOS / "stop" without one
        for tokens in bad:
            g = sub.groups[0]
            s0 = g.samples[0]
            forged = Sample(
                token_ids=pack_tokens(tokens), logprobs=b"\0\0\0\0" * len(tokens),
                finish_reason="stop", seed=s0.seed,
            )  # fmt: skip
            groups = [GroupResult(prompt_id=g.prompt_id, samples=[forged, *g.samples[1:]])]
            tampered = msgspec.structs.replace(sub, groups=groups + sub.groups[1:])
            verdict = _run(core.submit(node.public_key, tampered))
            assert isinstance(verdict, Reject) and verdict.code is ReasonCode.BAD_TERMINATION
    finally:
        core.close()


def _lease_request() -> LeaseRequest:
    return LeaseRequest(peer_id="peer", policy_version=1, max_prompts=2)


def _run(coro: object) -> object:
    import asyncio

    return asyncio.run(coro)  # type: ignore[arg-type]
