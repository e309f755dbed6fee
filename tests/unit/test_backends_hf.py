"""The ``hf`` backend: exact log-probs, seeding, termination, batching, weight swaps; scoring."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from node.backends import GenerationRequest, SampleOut, SamplingConfig, make_backend
from node.backends.hf import HFBackend
from policy.model import CharTokenizer, ModelSpec, build_model
from policy.scoring import score_logprobs

torch.set_num_threads(1)

TOK = CharTokenizer()
EOS = TOK.eos_token_id
# prompts of different lengths (3 .. 11 tokens) in one batch
PROMPTS = ["abc", "a", "dcbadcba", "bd", "abcdabcda"]


def requests(n: int = 3, seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(TOK.encode_prompt(p), n, seed=seed + i) for i, p in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(ModelSpec(), device="cpu")


@pytest.fixture(scope="module")
def eos_model() -> torch.nn.Module:
    """Copy of the embedded model whose lm_head has a bias towards EOS (EOS ~ 30-40% a step)."""
    model = copy.deepcopy(build_model(ModelSpec()))
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS] = 3.0
    model.lm_head = head
    return model


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], cfg: SamplingConfig
) -> list[float]:
    """Independent reference: one unpadded forward (default positions) of prompt+completion,
    then a per-position pure-Python temperature / top-k / top-p in float64 (same tie rules)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    out = []
    for i, tok in enumerate(completion):
        row = (logits[len(prompt) - 1 + i] / cfg.temperature).tolist()
        ranked = sorted(range(len(row)), key=lambda k: -row[k])  # stable: ties by token id
        kth = row[ranked[cfg.top_k - 1]] if cfg.top_k else -math.inf
        keep = {k for k in ranked if row[k] >= kth}  # top-k keeps ties at the k-th logit
        z = max(row)
        probs = {k: math.exp(row[k] - z) for k in keep}
        total = sum(probs.values())
        mass, nucleus = 0.0, set()
        for k in ranked:
            if k not in keep:
                continue
            if mass >= cfg.top_p and nucleus:
                break
            nucleus.add(k)
            mass += probs[k] / total
        if tok not in nucleus:
            out.append(float("-inf"))
            continue
        norm = sum(probs[k] for k in nucleus)
        out.append(math.log(probs[tok] / norm))
    return out


def assert_well_formed(sample: SampleOut, cfg: SamplingConfig, stops: set[int]) -> None:
    assert len(sample.token_ids) == len(sample.logprobs) >= 1
    assert all(0 <= t < TOK.vocab_size for t in sample.token_ids)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.logprobs)
    assert not any(t in stops for t in sample.token_ids[:-1]), "token after a stop token"
    if sample.finish_reason == "stop":
        assert sample.token_ids[-1] in stops
    else:
        assert sample.finish_reason == "length"
        assert len(sample.token_ids) == cfg.max_new_tokens
        assert sample.token_ids[-1] not in stops


@pytest.fixture(scope="module")
def twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference, another CPU's rounding of it): see policy.testing.rounding_twins."""
    from policy.testing import rounding_twins

    return rounding_twins()


@pytest.mark.parametrize("machine", ["same-cpu", "other-cpu"])
@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=12),
        SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=12),
        SamplingConfig(temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=12),
    ],
    ids=["plain", "t0.7-p0.9", "t1.3-k5-p0.8"],
)
def test_logprobs_match_fresh_forward(
    twins: tuple[torch.nn.Module, torch.nn.Module], cfg: SamplingConfig, machine: str
) -> None:
    """The node's log-probs against an independent float64 reference of the verifier's model.

    Away from the top-k/top-p boundaries they agree to 1e-4. At a boundary another machine's
    rounding may keep another token set (ties broken differently: 0.17 apart on a CPU other
    than the one this test was written on): there the claimed log-prob must lie in the
    admissible interval over the kept sets that rounding within the fp32 logit margin allows
    (policy.boundary) — the rule the coordinator's spot check applies."""
    from policy.boundary import DEFAULT_LOGIT_MARGIN, kept_bounds, logprob_interval

    reference, other = twins
    node_model = other if machine == "other-cpu" else reference
    node = HFBackend(ModelSpec(), device="cpu", model=node_model)
    groups = node.generate(requests(n=3), cfg)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    worst, boundary = 0.0, 0
    for req, group in zip(requests(n=3), groups, strict=True):
        for s in group:
            assert_well_formed(s, cfg, {EOS})
            ref = reference_logprobs(reference, req.prompt_token_ids, s.token_ids, cfg)
            with torch.no_grad():
                seq = torch.tensor([req.prompt_token_ids + s.token_ids])
                logits = reference(seq).logits[0].double()
            start = len(req.prompt_token_ids) - 1
            window = logits[start : start + len(s.token_ids)]
            bounds = kept_bounds(
                window, cfg.temperature, cfg.top_p, cfg.top_k, DEFAULT_LOGIT_MARGIN["float32"]
            )
            lo, hi = logprob_interval(bounds, torch.tensor(s.token_ids))
            for got, want, a, b in zip(s.logprobs, ref, lo.tolist(), hi.tolist(), strict=True):
                if a == b:  # no boundary token here: one value, the independent reference's
                    assert want == pytest.approx(a, abs=1e-9)
                    worst = max(worst, abs(got - want))
                else:
                    boundary += 1
                    assert a - 1e-4 <= got <= b + 1e-4, (got, a, b)
    assert worst < 1e-4
    if machine == "other-cpu" and cfg.top_k:
        assert boundary > 0  # the case this test guards: rounding flipped boundary tokens


def test_plain_logprobs_are_raw_model_logprobs(backend: HFBackend) -> None:
    cfg = SamplingConfig(max_new_tokens=6)
    req = requests(n=2)[0]
    for s in backend.generate([req], cfg)[0]:
        with torch.no_grad():
            logits = backend.model(torch.tensor([req.prompt_token_ids + s.token_ids])).logits[0]
        raw = torch.log_softmax(logits.double(), -1)
        start = len(req.prompt_token_ids) - 1
        expect = [raw[start + i, t].item() for i, t in enumerate(s.token_ids)]
        assert s.logprobs == pytest.approx(expect, abs=1e-5)


def test_nucleus_samples_only_from_nucleus(backend: HFBackend) -> None:
    """With a tiny top_p only the argmax survives: sampling must be greedy, log-probs 0."""
    cfg = SamplingConfig(top_p=1e-6, max_new_tokens=8)
    for req, group in zip(requests(n=2), backend.generate(requests(n=2), cfg), strict=True):
        for s in group:
            assert s.logprobs == pytest.approx([0.0] * len(s.logprobs), abs=1e-6)
            with torch.no_grad():
                logits = backend.model(torch.tensor([req.prompt_token_ids + s.token_ids])).logits
            start = len(req.prompt_token_ids) - 1
            greedy = logits[0, start : start + len(s.token_ids)].argmax(-1).tolist()
            assert s.token_ids == greedy


def test_score_logprobs_matches_reference(backend: HFBackend) -> None:
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=10)
    groups = backend.generate(requests(n=2), cfg)
    prompts = [r.prompt_token_ids for r in requests(n=2) for _ in range(2)]
    comps = [s.token_ids for g in groups for s in g]
    prompts.append(TOK.encode_prompt("ab"))
    comps.append([])  # empty completion -> []
    scored = score_logprobs(backend.model, prompts, comps, temperature=0.7, top_p=0.9, batch_size=3)
    assert scored[-1] == []
    for p, c, got in zip(prompts[:-1], comps[:-1], scored[:-1], strict=True):
        assert got == pytest.approx(reference_logprobs(backend.model, p, c, cfg), abs=1e-4)
    sampled = [s.logprobs for g in groups for s in g]
    for a, b in zip(sampled, scored[:-1], strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_seeded_sampling_is_reproducible(backend: HFBackend) -> None:
    cfg = SamplingConfig(temperature=0.9, max_new_tokens=10)
    a = backend.generate(requests(n=4, seed=7), cfg)
    b = backend.generate(requests(n=4, seed=7), cfg)
    assert a == b
    c = backend.generate(requests(n=4, seed=8), cfg)
    assert [s.token_ids for g in a for s in g] != [s.token_ids for g in c for s in g]
    # samples within a group differ (their own streams)
    assert len({tuple(s.token_ids) for s in a[2]}) > 1


def test_samples_independent_of_batch_composition_and_n(backend: HFBackend) -> None:
    cfg = SamplingConfig(max_new_tokens=10)
    full = backend.generate(requests(n=3, seed=3), cfg)
    target = requests(n=3, seed=3)[2]
    alone = backend.generate([target], cfg)[0]
    more = backend.generate([GenerationRequest(target.prompt_token_ids, 5, target.seed)], cfg)[0]
    for x, y, z in zip(full[2], alone, more[:3], strict=True):
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert x.logprobs == pytest.approx(z.logprobs, abs=1e-5)
    small = HFBackend(ModelSpec(), device="cpu", model=backend.model, max_batch_rows=4)
    chunked = small.generate(requests(n=3, seed=3), cfg)
    assert [[s.token_ids for s in g] for g in chunked] == [[s.token_ids for s in g] for g in full]


def test_eos_ends_sample_and_length_caps_it(eos_model: torch.nn.Module) -> None:
    backend = HFBackend(ModelSpec(), device="cpu", model=eos_model)
    assert backend.eos_token_ids == (EOS,)
    cfg = SamplingConfig(max_new_tokens=4)
    groups = backend.generate(requests(n=8), cfg)
    reasons = [s.finish_reason for g in groups for s in g]
    assert "stop" in reasons and "length" in reasons
    lengths = {len(s.token_ids) for g in groups for s in g}
    assert len(lengths) > 2  # ragged: rows end at different steps
    for req, group in zip(requests(n=8), groups, strict=True):
        for s in group:
            assert_well_formed(s, cfg, {EOS})
            ref = reference_logprobs(eos_model, req.prompt_token_ids, s.token_ids, cfg)
            assert s.logprobs == pytest.approx(ref, abs=1e-4)


def test_extra_stop_tokens(backend: HFBackend) -> None:
    stop = TOK.encode("a")[0]
    cfg = SamplingConfig(max_new_tokens=30, stop_token_ids=(EOS, stop))
    groups = backend.generate(requests(n=6), cfg)
    hit = 0
    for group in groups:
        for s in group:
            assert_well_formed(s, cfg, {EOS, stop})
            hit += s.token_ids[-1] == stop
    assert hit > 0


def test_the_stop_set_is_exactly_the_given_one(backend: HFBackend) -> None:
    """A lease's stop set is used as is: a token outside it (here the model's own EOS) does not
    end a sample; ``None`` (local use) means the model's EOS ids."""
    stop = TOK.encode("a")[0]
    only = SamplingConfig(max_new_tokens=30, stop_token_ids=(stop,))
    samples = [s for g in backend.generate(requests(n=6), only) for s in g]
    for s in samples:
        assert_well_formed(s, only, {stop})
        assert s.finish_reason == "length" or s.token_ids[-1] == stop
    assert any(EOS in s.token_ids[:-1] for s in samples)  # EOS generated, did not stop
    assert backend.stop_set(SamplingConfig()) == frozenset({EOS})


def test_load_state_dict_swaps_weights_in_place(backend: HFBackend) -> None:
    other = build_model(ModelSpec(), seed=1)
    swapped = HFBackend(ModelSpec(), device="cpu", model=copy.deepcopy(backend.model))
    ptrs = [p.data_ptr() for p in swapped.model.parameters()]
    cfg = SamplingConfig(max_new_tokens=8)
    before = swapped.generate(requests(n=2), cfg)
    swapped.load_state_dict(5, other.state_dict())
    assert swapped.loaded_version == 5
    assert [p.data_ptr() for p in swapped.model.parameters()] == ptrs
    after = swapped.generate(requests(n=2), cfg)
    expect = HFBackend(ModelSpec(), device="cpu", model=other).generate(requests(n=2), cfg)
    assert after == expect
    assert after != before
    with pytest.raises(ValueError, match="does not fit"):
        swapped.load_state_dict(6, {"bogus.weight": torch.zeros(1)})


def test_rejects_bad_inputs(backend: HFBackend) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.generate([GenerationRequest([1, 99], 1, 0)], SamplingConfig())
    with pytest.raises(ValueError, match="positions"):
        backend.generate(requests(n=1), SamplingConfig(max_new_tokens=60))
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest([], 1, 0)


def test_make_backend_hf_and_auto_on_cpu() -> None:
    assert isinstance(make_backend("hf", ModelSpec(), device="cpu"), HFBackend)
    if not torch.cuda.is_available():
        assert make_backend("auto", ModelSpec()).name == "hf"
