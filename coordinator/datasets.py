"""GSM8K-style math prompts from a JSONL file, rewarded with ``math-verify`` under a hard timeout.

Each line is a JSON object with a question (``prompt_field``) and an answer (``answer_field``). The
reference answer and a completion's answer are read the same way (:func:`extract_answer`): the
content of the last ``\\boxed{...}`` if there is one, else the text after the last ``####``
(GSM8K convention), else the whole text (math-verify extracts the final expression); commas are
dropped. :class:`MathReward` turns that into a reward in [0, 1]: correctness, plus an optional
share for a well-formed answer (``format_reward``: a finished completion with a ``\\boxed{}`` or
``####`` answer).

``math-verify`` runs sympy, which can take unbounded time on adversarial input (a node controls the
completion text). Its own timeout relies on ``signal.alarm`` and only works in a main thread, so the
check runs in a dedicated worker *process*: the caller waits at most ``timeout_s``, and a worker
that overruns is killed (by its PID) and restarted lazily. A timed-out check scores 0.

**Held-out split** (the held-out evaluation, :mod:`policy.evaluation`): a row whose question's
hash falls in one bucket of :data:`HELDOUT_EVERY` (:func:`held_out`) is held out: the training
stream (:meth:`JsonlMathTask.problem`) never gives it, :meth:`JsonlMathTask.heldout` lists it.
The split depends on the question text only (not on the seed or the row order), so the same file
always splits the same way and a question repeated in the file is on one side only.
"""

from __future__ import annotations

import contextlib
import hashlib
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
#: one JSONL question in this many (by hash) is held out of training
HELDOUT_EVERY = 10


def held_out(key: str, every: int) -> bool:
    """Whether ``key`` falls in the held-out bucket: one key in ``every``, by a hash of the key
    (stable across processes and Python versions)."""
    digest = hashlib.blake2b(f"rollout-swarm/heldout/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % every == 0


def boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced;
    None when there is none (an unclosed one does not count)."""
    found: str | None = None
    found_at = -1
    for macro in ("\\boxed{", "\\fbox{"):
        start = 0
        while (at := text.find(macro, start)) >= 0:
            depth, i = 1, at + len(macro)
            while i < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            if depth == 0 and at >= found_at:
                found, found_at = text[at + len(macro) : i - 1], at
            start = at + 1
    return found


def extract_answer(text: str) -> str:
    """The answer in ``text``: the last ``\\boxed{}``'s content, else the text after the last
    ``####``, else ``text`` (commas and surrounding whitespace dropped)."""
    boxed = boxed_answer(text)
    if boxed is not None:
        text = boxed
    elif "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


def well_formed(completion: str, finished: bool) -> bool:
    """A finished completion that states its answer as ``\\boxed{...}`` or after ``####``."""
    if not finished:
        return False
    boxed = boxed_answer(completion)
    if boxed is not None:
        return bool(boxed.strip())
    return "####" in completion and bool(completion.rsplit("####", 1)[1].strip())


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
    # Warm up first: math-verify imports sympy on its first use (seconds, more on a busy machine),
    # which would otherwise count against the first real check's timeout and score it 0. The
    # start-up timeout covers this.
    with contextlib.suppress(Exception):
        fn("1", "1")
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


class MathReward:
    """Reward of a math completion, computed on the coordinator (see the module docstring):
    ``(1 − format_reward) · correct + format_reward · well_formed``; ``exact`` is correctness.
    The last few verdicts are kept, so ``reward`` then ``exact`` of one completion verify once."""

    def __init__(
        self, *, format_reward: float = 0.0, timeout_s: float = 5.0, equal_fn: EqualFn = math_equal
    ) -> None:
        if not 0.0 <= format_reward <= 1.0:
            raise ValueError(f"format_reward must be in [0, 1], got {format_reward}")
        self.format_reward = format_reward
        self.worker = VerifyWorker(equal_fn, timeout_s)
        self._recent: dict[tuple[str, str], bool] = {}

    def correct(self, answer: str, completion: str) -> bool:
        key = (answer, completion)
        if key in self._recent:
            return self._recent[key]
        pred = extract_answer(completion)
        ok = bool(pred) and bool(self.worker.call(answer, pred))
        if len(self._recent) >= 64:
            self._recent.pop(next(iter(self._recent)))
        self._recent[key] = ok
        return ok

    def reward(self, answer: str, completion: str, finished: bool) -> float:
        correct = 1.0 if self.correct(answer, completion) else 0.0
        if not self.format_reward:
            return correct
        formed = 1.0 if well_formed(completion, finished) else 0.0
        return (1.0 - self.format_reward) * correct + self.format_reward * formed

    def close(self) -> None:
        self.worker.close()


class JsonlMathTask:
    """Math word problems from a JSONL file (a deterministic shuffle per pass over the training
    rows; the held-out rows apart, see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        seed: int = 0,
        prompt_field: str = "question",
        answer_field: str = "answer",
        *,
        template: str = "{question}\nPut the final answer in \\boxed{{}}.",
        timeout_s: float = 5.0,
        equal_fn: EqualFn = math_equal,
        format_reward: float = 0.0,
    ) -> None:
        self.path = Path(path)
        self.seed = seed
        self.template = template
        self.name = f"jsonl:{self.path.name}"
        rows: list[tuple[str, str]] = []
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
                rows.append((question, extract_answer(answer)))
        if not rows:
            raise ValueError(f"{self.path}: no problems in the file")
        self._heldout = [r for r in rows if held_out(f"jsonl/{r[0]}", HELDOUT_EVERY)]
        self._rows = [r for r in rows if not held_out(f"jsonl/{r[0]}", HELDOUT_EVERY)]
        if not self._rows:
            raise ValueError(
                f"{self.path}: all {len(rows)} problems fall in the held-out split (one question "
                f"in {HELDOUT_EVERY} by hash); add problems to the file"
            )
        self.scorer = MathReward(
            format_reward=format_reward, timeout_s=timeout_s, equal_fn=equal_fn
        )
        self.worker = self.scorer.worker

    def __len__(self) -> int:
        """Training problems (the held-out ones apart)."""
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

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems in file order; ValueError when there are fewer."""
        if n > len(self._heldout):
            raise ValueError(
                f"{self.path} holds out {len(self._heldout)} problems (one question in "
                f"{HELDOUT_EVERY} by hash), fewer than the {n} asked; lower eval_prompts"
            )
        return [
            Problem(
                prompt_id=f"{self.name}:heldout:{k:04d}",
                prompt=self.template.format(question=question),
                answer=answer,
            )
            for k, (question, answer) in enumerate(self._heldout[:n])
        ]

    def reward(self, problem: Problem, completion: str, finished: bool) -> float:
        return self.scorer.reward(problem.answer, completion, finished)

    def exact(self, problem: Problem, completion: str, finished: bool) -> bool:
        return self.scorer.correct(problem.answer, completion)

    def close(self) -> None:
        self.scorer.close()
