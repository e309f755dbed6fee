"""Models built on several threads at once come out whole (policy.model._BUILD_LOCK).

transformers' ``from_pretrained`` builds under process-wide state; without the lock, three
concurrent loads of a tied-embedding model left ``lm_head.weight`` on the meta device in every
one of them (the coordinator then scored every token of that version -inf and banned honest
nodes: the CI failure of test_real_tokenizer_swarm).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from policy.model import ModelSpec, build_model
from policy.testing import build_tiny_chat_model


def test_concurrent_builds_are_whole_and_tied(tmp_path: Path) -> None:
    spec = ModelSpec(path=str(build_tiny_chat_model(tmp_path / "model")))
    reference = build_model(spec)
    built: list[torch.nn.Module] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            built.append(build_model(spec))
        except BaseException as exc:  # surfaced below, with the thread's failure
            errors.append(exc)

    for _ in range(3):
        threads = [threading.Thread(target=build) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a build did not finish in 120 s"
    assert not errors, errors
    assert len(built) == 9
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = reference(ids).logits
    for model in built:
        assert not [n for n, p in model.named_parameters() if p.is_meta]
        assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
        with torch.no_grad():
            logits = model(ids).logits
        assert torch.isfinite(logits).all()
        # same weights from the same files, same code path: equal up to float rounding
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
