"""GSM8K-style math prompts from a JSONL file, rewarded with ``math-verify`` under a hard timeout.

Each line is a JSON object with a question (``prompt_field``) and an answer (``answer_field``). The
reference answer is the text after the last ``####`` (GSM8K convention, commas dropped), or the
whole answer field when there is none. A completion is scored the same way: the text after its last
``####`` if present, else the whole completion (math-verify extracts the final expression).

``math-verify`` runs sympy, which can take unbounded time on adversarial input (a node controls the
completion text). Its own timeout relies on ``signal.alarm`` and only works in a main thread, so the
check runs in a dedicated worker *process*: the caller waits at most ``timeout_s``, and a worker
that overruns is killed (by its PID) and restarted lazily. A timed-out check scores 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import random
import threading
from collections.abc import Callable
from functools import lru_cache
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from coordinator.problems import Problem

log = logging.getLogger(__name__)

EqualFn = Callable[[str, str], bool]


def extract_answer(text: str) -> str:
    """The text after the last ``####`` (commas and whitespace stripped), else ``text`` stripped."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


def math_equal(gold: str, pred: str) -> bool:
    """``math_verify.verify(parse(gold), parse(pred))``; runs inside the worker process."""
    from math_verify import parse, verify

    gold_parsed = parse(gold)
    pred_parsed = parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed))


def _serve(conn: Connection, fn: EqualFn) -> None:
    """Worker process loop: answer ``(gold, pred)`` requests until ``None`` or EOF."""
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        gold, pred = request
        try:
            conn.send(bool(fn(gold, pred)))
        except Exception as exc:  # a verifier crash on odd input scores 0, never kills the worker
            conn.send(f"error: {type(exc).__name__}: {exc}")


class VerifyWorker:
    """One child process running ``fn``; calls wait at most ``timeout_s``; thread-safe."""

    def __init__(self, fn: EqualFn, timeout_s: float, startup_timeout_s: float = 60.0) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = 0
        self._ctx = mp.get_context("spawn")  # no fork of a multi-threaded coordinator
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.fn), daemon=True)
        proc.name = "math-verify"
        proc.start()
        child.close()
        if not parent.poll(self.startup_timeout_s) or parent.recv() != "ready":
            self._kill(proc)
            raise TimeoutError(f"math-verify worker did not start in {self.startup_timeout_s}s")
        self._proc, self._conn = proc, parent
        return parent

    @staticmethod
    def _kill(proc: BaseProcess) -> None:
        proc.kill()
        proc.join(timeout=5)

    def call(self, gold: str, pred: str) -> bool | None:
        """``fn(gold, pred)``; None when it did not finish within ``timeout_s`` (worker killed)."""
        with self._lock:
            conn = self._conn
            if conn is None or self._proc is None or not self._proc.is_alive():
                conn = self._start()
            conn.send((gold, pred))
            if conn.poll(self.timeout_s):
                result = conn.recv()
                if isinstance(result, str):
                    log.warning("math-verify failed on %r: %s", pred[:80], result)
                    return False
                return bool(result)
            self.timeouts += 1
            assert self._proc is not None
            log.warning(
                "math-verify exceeded %.1fs on %r; worker restarted", self.timeout_s, pred[:80]
            )
            self._kill(self._proc)
            self._proc, self._conn = None, None
            return None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._proc is not None:
                with contextlib.suppress(OSError):
                    self._conn.send(None)
                self._proc.join(timeout=2)
                if self._proc.is_alive():
                    self._kill(self._proc)
            self._proc, self._conn = None, None


class JsonlMathTask:
    """Math word problems from a JSONL file (a deterministic shuffle per pass over the file)."""

    def __init__(
        self,
        path: str | Path,
        seed: int = 0,
        prompt_field: str = "question",
        answer_field: str = "answer",
        *,
        template: str = "{question}\nGive the final answer after ####.\n",
        timeout_s: float = 5.0,
        equal_fn: EqualFn = math_equal,
    ) -> None:
        self.path = Path(path)
        self.seed = seed
        self.template = template
        self.name = f"jsonl:{self.path.name}"
        self._rows: list[tuple[str, str]] = []
        with self.path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    question, answer = str(row[prompt_field]), str(row[answer_field])
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{self.path}:{lineno}: need a JSON object with {prompt_field!r} and "
                        f"{answer_field!r} ({exc})"
                    ) from exc
                self._rows.append((question, extract_answer(answer)))
        if not self._rows:
            raise ValueError(f"{self.path}: no problems in the file")
        self.worker = VerifyWorker(equal_fn, timeout_s)

    def __len__(self) -> int:
        return len(self._rows)

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of permutations per task object
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        random.Random(f"{self.name}:{self.seed}:{epoch}").shuffle(order)
        return order

    def problem(self, index: int) -> Problem:
        epoch, pos = divmod(index, len(self._rows))
        question, answer = self._rows[self._order(epoch)[pos]]
        prompt = self.template.format(question=question)
        return Problem(prompt_id=f"{self.name}:{index:08d}", prompt=prompt, answer=answer)

    def reward(self, problem: Problem, completion: str, finished: bool) -> float:
        pred = extract_answer(completion)
        if not pred:
            return 0.0
        return 1.0 if self.worker.call(problem.answer, pred) else 0.0

    def exact(self, problem: Problem, completion: str, finished: bool) -> bool:
        return self.reward(problem, completion, finished) == 1.0

    def close(self) -> None:
        self.worker.close()
