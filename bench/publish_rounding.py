"""How often a node's sampled token falls outside the trainer's top-k/top-p support because the
version it runs is the trainer's weights rounded to ``publish_dtype``.

The node (``hf`` backend) holds ``cast_floats(trainer weights, publish_dtype)`` and samples arith
prompts rendered with the chat template; the trainer re-scores each completion from its fp32
weights with ``trainer.loss.token_logprobs`` (the processed distribution). A token outside the
trainer's support gets π_prox = 0: behaviour weight 0, counted apart in ``out_of_support_frac``
and left out of ``mismatch_kl`` (before issue 32: 59 nats in its k3 sum, the ±60 clamp of
``trainer.loss.weight_stats``). Each row gives both: ``mismatch_kl`` (per shared token, as the
step record now has it) and ``mismatch_kl_clamped`` (per token, as it was). Exact counts (a
deterministic model, prompts and
seeds); the CPU time is only informative.

    python bench/publish_rounding.py                               # bf16 and float32, 1000 prompts
    python bench/publish_rounding.py --dtypes bfloat16 --prompts 20   # a quick check

Default model: test_real_tokenizer_swarm's (``policy.testing.build_tiny_chat_model``, random,
vocabulary 400) at its sampling settings (T 0.8, top-p 0.95, 8 new tokens, groups of 4).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default=None, help="HF model directory (default: tiny chat)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=1000, help="prompts per dtype (groups of 4)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=8, help="max new tokens")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from coordinator.arith import ArithmeticTask
    from node.backends.base import GenerationRequest
    from node.backends.hf import HFBackend
    from policy.model import ModelSpec, build_model, load_tokenizer
    from policy.prompts import PromptRenderer
    from policy.sampling import SamplingConfig
    from policy.testing import build_tiny_chat_model
    from swarm.checkpoint_io import cast_floats
    from trainer.loss import (
        LOGP_FLOOR,
        k3_terms,
        shared_log_ratio,
        support_mask,
        token_logprobs,
    )

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="publish-rounding-")
    path = args.model_path or str(build_tiny_chat_model(Path(tmp.name) / "model"))
    spec = ModelSpec(path=path)
    trainer = build_model(spec)
    state = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    render = PromptRenderer(load_tokenizer(spec), template="chat", system_prompt="Answer briefly.")
    task = ArithmeticTask(0)
    processing = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    results = []
    for dtype in args.dtypes:
        node = HFBackend(spec, device="cpu")
        node.load_state_dict(0, cast_floats(state, dtype))
        sampling = SamplingConfig(
            **processing, max_new_tokens=args.tokens, stop_token_ids=node.eos_token_ids
        )
        rng = random.Random(args.seed)
        tokens = outside = 0
        kl_shared = kl_clamped = shared_tokens = 0.0
        cases: list[list[int]] = []
        t0 = time.process_time()
        for _ in range(args.prompts):
            index = rng.randrange(10**6)
            prompt = render.render(task.problem(index).prompt)
            req = GenerationRequest(prompt, n=4, seed=rng.getrandbits(63))
            (group,) = node.generate([req], sampling)
            for j, sample in enumerate(group):
                ids = torch.tensor([req.prompt_token_ids + sample.token_ids])
                with torch.no_grad():
                    logits = trainer(input_ids=ids).logits[0, len(req.prompt_token_ids) - 1 : -1]
                lp = token_logprobs(logits, torch.tensor(sample.token_ids), **processing)
                tokens += len(sample.token_ids)
                # the step record's mismatch_kl (k3 over the shared support) and what the ±60
                # clamp made of the same tokens before issue 32 (float64 sums)
                mu = torch.tensor(sample.logprobs, dtype=lp.dtype)
                shared = support_mask(lp, mu, torch.ones_like(lp))
                log_r = shared_log_ratio(lp, mu, shared).double()
                kl_shared += float(k3_terms(log_r).sum())
                shared_tokens += float(shared.sum())
                log_c = (lp - mu).clamp(-60.0, 60.0).double()
                kl_clamped += float(k3_terms(log_c).sum())
                for t in (lp <= LOGP_FLOOR).nonzero().flatten().tolist():
                    outside += 1
                    cases.append([index, req.seed, j, t])
        row = {
            "publish_dtype": dtype,
            "prompts": args.prompts,
            "tokens": tokens,
            "outside_support": outside,
            "rate": outside / max(1, tokens),
            "mismatch_kl": kl_shared / max(1.0, shared_tokens),
            "mismatch_kl_clamped": kl_clamped / max(1, tokens),
            "cases": cases[:10],  # [arith problem index, lease seed, sample, position]
            "cpu_s": round(time.process_time() - t0, 1),
        }
        print(json.dumps(row), flush=True)
        results.append(row)
    task.close()
    tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
