"""The sampling contract: what "a sample of policy version v" means, in one home.

The node draws samples, the coordinator re-scores and replays them, the trainer weights them; all
three import this package and none imports another role's internals (DESIGN.md §12). It sits
beside the role packages rather than inside one of them because it is shared by all three, and
it must not pull in a role's dependencies (hivemind, SQLite, the GRPO recipe).

Modules:

* :mod:`policy.sampling` -- :class:`~policy.sampling.SamplingConfig`, the prompt and sample seed
                            derivations (no torch import)
* :mod:`policy.model`    -- :class:`~policy.model.ModelSpec`, the tokenizers (embedded character
                            tokenizer, local Hugging Face), model building and weight loading
* :mod:`policy.draw`     -- the processed distribution (temperature → top-k → top-p), the seeded
                            uniforms (SplitMix64) and the inverse-CDF draw: the sampling rule of
                            every backend
* :mod:`policy.scoring`  -- batched re-scoring of completions and sampling audits
* :mod:`policy.boundary` -- top-k/top-p boundary tokens: the kept sets another machine's rounding
                            may give, admissible log-prob intervals and replayed draws
* :mod:`policy.prompts`  -- question text -> prompt tokens (chat template or plain)
* :mod:`policy.preflight`-- impossible set-ups refused at start (positions, EOS, vocabulary)
* :mod:`policy.importer` -- ``swarm model import``: GGUF / HF directory -> local safetensors
                            directory, named models (``smollm2``), fingerprints
* :mod:`policy.lora`     -- LoRA versions: the adapter format, the base model's fingerprint,
                            adapters applied over one loaded base (merged or unmerged)
* :mod:`policy.evaluation`-- the held-out evaluation's protocol: greedy accuracy and pass@1 on
                            a fixed prompt set with Wilson intervals, the decoding loop
* :mod:`policy.testing`  -- test helpers: a tiny Llama with a real BPE tokenizer, chat template and
                            two EOS ids; a model and its twin with another CPU's rounding

Nothing is imported here, so importing the package stays cheap.
"""
