"""node.checkpoints' progress lines tell the truth: 'downloaded policy vN' only for a download that
completed. (A trainer killed mid-publication leaves the coordinator announcing a version whose
chunks nobody serves until it is back; the nodes' logs said 'downloaded' for every failed try.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_node_checkpoints import World

from node.checkpoints import CheckpointUnavailable


async def test_a_failed_download_is_not_logged_as_downloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world = World(tmp_path)
    await world.start()
    try:
        await world.publish(1)
        world.seed.server.load_chunk = lambda version, index: None  # type: ignore[method-assign]
        mgr, backend = await world.manager()
        mgr.progress = True
        with caplog.at_level(logging.INFO, logger="node.checkpoints"):
            with pytest.raises(CheckpointUnavailable):
                await mgr.ensure(1)
            assert backend.loads == []
            assert "downloading policy v1" in caplog.text
            assert "downloaded policy v1" not in caplog.text
            caplog.clear()
            world.seed.server.load_chunk = world.seed_store.get_chunk  # type: ignore[method-assign]
            await mgr.ensure(1)
        assert "downloaded policy v1" in caplog.text and "loaded policy v1" in caplog.text
    finally:
        await world.close()
