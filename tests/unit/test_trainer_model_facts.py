"""trainer.network._model_facts: the model's identity the trainer publishes with (its config and
tokenizer hashes, as the coordinator checks them) and the positions the sampling contract is
checked against, computed in a thread while the trainer joins the swarm."""

from __future__ import annotations

import asyncio

from policy.model import ModelSpec, config_fingerprint, load_config, load_tokenizer, max_positions
from trainer.network import _model_facts, _retrieved
from trainer.swarm_client import digest_hex


def test_the_facts_are_the_models() -> None:
    spec = ModelSpec(path=None, dtype="float32")
    assert _model_facts(spec) == (
        digest_hex(config_fingerprint(load_config(spec))),
        digest_hex(load_tokenizer(spec).fingerprint()),
        max_positions(spec),
    )


async def test_a_failure_left_behind_is_not_reported_as_unretrieved() -> None:
    # the start-up may end (a stop, a failure to join) before it awaits the facts' thread
    seen: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:

        def fail() -> None:
            raise ValueError("no such model")

        future = asyncio.ensure_future(asyncio.to_thread(fail))
        future.add_done_callback(_retrieved)
        await asyncio.wait([future])
        del future
        import gc

        gc.collect()
        await asyncio.sleep(0)
        assert seen == []
    finally:
        loop.set_exception_handler(None)
