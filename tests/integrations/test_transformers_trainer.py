"""A patched transformers model in a trainer's hands: gradients, batch composition, generate() with its cache.

Under triton_bf16 a token's logprob and the gradient reaching its input embedding have the same bits alone, in
a padded batch of different-length neighbours (either padding side) or packed; gradients are deterministic
and equal rl_engine's DecoderModel's; generate() through transformers' DynamicCache picks the tokens the
rollout engine picks and its per-step logprobs are the teacher-forced ones. One layer, V=64 (MICRO): the
Triton interpreter runs each test in seconds.
"""

import pytest
import torch
from test_transformers import decoder, hf_model

from rl_engine.errors import UsageError
from rl_engine.integrations.transformers import patch, selected_logprobs
from rl_engine.rollout import Request, RolloutEngine, SamplingParams

MICRO = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16}
LENGTHS = (5, 8, 3)  # the sequence under test, then its neighbours


def patched(profile, family="qwen3"):
    model = hf_model(family, profile, layers=1, dims=MICRO)
    patch(model, profile)
    return model


def sequences(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MICRO["vocab_size"], (n,), generator=g) for n in LENGTHS]


def padded(seqs, side):
    """ids, attention mask, and each row's token slice, padded to the longest on `side`."""
    s = max(len(q) for q in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.long)
    spans = []
    for b, q in enumerate(seqs):
        span = slice(0, len(q)) if side == "right" else slice(s - len(q), s)
        ids[b, span], mask[b, span] = q, 1
        spans.append(span)
    return ids, mask, spans


def layout_mismatches(model):
    """(layout, row) where a sequence's logprobs differ from its logprobs alone: right/left padded among
    different-length neighbours, packed."""
    seqs, bad = sequences(), []
    with torch.no_grad():
        alone = [selected_logprobs(model, q[None])[0] for q in seqs]
        for side in ("right", "left"):
            ids, mask, spans = padded(seqs, side)
            lp = selected_logprobs(model, ids, attention_mask=mask)
            # logp of tokens span.start+1.. sits at columns span.start..
            bad += [(side, b) for b, sp in enumerate(spans) if not torch.equal(lp[b, sp.start:sp.stop - 1], alone[b])]
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        lp = selected_logprobs(model, torch.cat(seqs)[None], cu_seqlens=cu)
        bad += [("packed", b) for b in range(len(seqs)) if not torch.equal(lp[0, cu[b]:cu[b + 1] - 1], alone[b])]
    return bad


def test_selected_logprobs_batch_invariant_triton():
    assert layout_mismatches(patched("triton_bf16")) == []


def test_layout_check_sees_a_planted_bug(monkeypatch):
    """Attention that ignores left padding (seq_starts dropped) must show in the left-padded rows."""
    import rl_engine.integrations.transformers as integration

    monkeypatch.setattr(integration, "_padding_layout", lambda mask, node: {})
    bad = layout_mismatches(patched("torch_bf16"))
    assert ("left", 0) in bad and ("left", 2) in bad and ("right", 0) not in bad


def _grads(model, run):
    """Parameter gradients and d loss / d input embeddings of `run(embed_hook_list)`, from zero."""
    model.zero_grad(set_to_none=True)
    captured = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: captured.append(o) or o.retain_grad())
    try:
        run().backward()
    finally:
        hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, captured[0].grad


def _batch_loss(model, ids, mask):
    # The sum of each sequence's logprobs: a logprob whose context or target is padding is left out, as trainers
    # mask it.
    lp = selected_logprobs(model, ids, attention_mask=mask)
    return (lp * mask[:, :-1] * mask[:, 1:]).sum()


def _decoder_loss(model, profile, ids, mask):
    """The same loss through rl_engine's DecoderModel on the model's own Parameters."""
    ours = decoder(model, profile)
    ours.w = dict(model.named_parameters(remove_duplicate=False))  # the Parameters, so gradients reach them
    embeds = model.model.embed_tokens(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = ours.forward(positions=positions, embeds=embeds, seq_starts=(1 - mask).sum(-1).to(torch.int32))
    return (ours.selected_logprobs(hidden[:, :-1], ids[:, 1:]) * mask[:, :-1] * mask[:, 1:]).sum()


def test_gradients_triton():
    """Gradients reach every parameter transformers' own model trains, are deterministic, equal DecoderModel's,
    and d(sum of a sequence's logprobs)/d(its input embeddings) has the same bits alone and in a batch."""
    profile = "triton_bf16"
    model = patched(profile)
    seqs = sequences()
    ids, mask, spans = padded(seqs[:2], "left")
    grads, d_embeds = _grads(model, lambda: _batch_loss(model, ids, mask))
    theirs = hf_model("qwen3", profile, layers=1, dims=MICRO)
    theirs(input_ids=ids, attention_mask=mask).logits.float().sum().backward()
    assert set(grads) == {n for n, p in theirs.named_parameters() if p.grad is not None}
    assert all(g.abs().max() > 0 for g in grads.values())
    again, d_again = _grads(model, lambda: _batch_loss(model, ids, mask))
    assert torch.equal(d_again, d_embeds) and all(torch.equal(again[n], g) for n, g in grads.items())
    ref, d_ref = _grads(model, lambda: _decoder_loss(model, profile, ids, mask))
    assert torch.equal(d_ref, d_embeds)
    assert [n for n, g in grads.items() if not torch.equal(ref[n], g)] == []
    _, alone = _grads(model, lambda: selected_logprobs(model, seqs[0][None]).sum())
    assert torch.equal(d_embeds[0, spans[0]], alone[0])


def test_gradients_torch_profile():
    """torch_bf16 gradients are deterministic and equal DecoderModel's. Batch invariance is not claimed (torch
    picks kernels by shape), only measured: on this CPU (torch 2.13, MICRO, sequences()) the logprobs and
    input gradients of a sequence alone and padded among neighbours matched bit for bit, packed they did not
    (max|Δ| 1.4e-4 in logprobs, 1.6e-2 in bf16 input gradients); a GPU's cuBLAS promises neither."""
    profile = "torch_bf16"
    model = patched(profile)
    ids, mask, _ = padded(sequences()[:2], "left")
    grads, d_embeds = _grads(model, lambda: _batch_loss(model, ids, mask))
    again, d_again = _grads(model, lambda: _batch_loss(model, ids, mask))
    assert torch.equal(d_again, d_embeds) and all(torch.equal(again[n], g) for n, g in grads.items())
    ref, d_ref = _grads(model, lambda: _decoder_loss(model, profile, ids, mask))
    assert torch.equal(d_ref, d_embeds)
    assert [n for n, g in grads.items() if not torch.equal(ref[n], g)] == []


def _generate(model, prompt, n):
    # generate's default cache is a DynamicCache (its keyword is past_key_values in 5.17, cache later).
    return model.generate(prompt, max_new_tokens=n, do_sample=False, output_logits=True, output_hidden_states=True,
                          return_dict_in_generate=True, pad_token_id=0)


def test_generate_with_dynamic_cache_equals_rollout_and_teacher_forcing_triton():
    profile, n = "triton_bf16", 3
    model = patched(profile)
    prompt = sequences()[0][None]
    with torch.no_grad():
        out = _generate(model, prompt, n)
        new = out.sequences[0, prompt.shape[1]:]
        assert len(new) == n
        # Greedy decoding by rl_engine's rollout engine (paged cache, its own prefill) on the same weights.
        engine = RolloutEngine(decoder(model, profile), max_batch_size=1, num_pages=4)
        done = engine.generate([Request(0, tuple(prompt[0].tolist()), SamplingParams(temperature=0, max_new_tokens=n))])
        assert done[0].token_ids == new.tolist()
        # Per step: the last hidden row (prefill, then each decode through the cache) -> the patched head.
        head = model._rl_engine_patch.head
        rows = torch.cat([step[-1][:, -1:] for step in out.hidden_states], 1)  # final-normed, [1,n,H]
        stepwise = head(rows, new[None])[0]
        teacher = selected_logprobs(model, out.sequences)[0, -n:]
        assert torch.equal(stepwise, teacher) and torch.equal(stepwise, done[0].raw_logprobs)
        # The logits generate picked from are the lm_head op's: the bits of a teacher-forced forward's rows.
        hidden = model.model(input_ids=out.sequences).last_hidden_state[:, prompt.shape[1] - 1:-1]
        assert torch.equal(torch.cat(out.logits), model.lm_head(hidden)[0].float())
        # log_softmax of those bf16 logits is not the fp32 linear_logp (the logits were rounded to bf16).
        from_logits = torch.log_softmax(torch.cat(out.logits), -1).gather(-1, new[:, None])[:, 0]
        torch.testing.assert_close(from_logits, teacher, rtol=0, atol=2e-2)


@pytest.mark.parametrize("case", ["padded", "static"])
def test_generate_refusals_are_one_line(case):
    model = patched("torch_bf16")
    if case == "padded":  # a left-padded batch prefills, then its first decode step is refused
        ids, mask, _ = padded(sequences()[:2], "left")
        kwargs, match = {"attention_mask": mask}, "decoding with a padding mask"
    else:
        ids, kwargs, match = sequences()[0][None], {"cache_implementation": "static"}, "only transformers' DynamicCache"
    with pytest.raises(UsageError, match=match) as exc, torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **kwargs)
    assert "\n" not in str(exc.value)


def test_a_given_packed_layout_is_used_and_equals_the_detected_one():
    # Trainers pass the packed layout as transformers' flash-attention kwargs (cu_seq_lens_q/k); the patched
    # attention takes it as given (no reading of positions: what lets a compiled model avoid graph breaks).
    model = patched("triton_bf16")
    seqs = sequences()
    ids = torch.cat(seqs)[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]

    def hidden(**kw):
        with torch.no_grad():
            return model.model(input_ids=ids, position_ids=pos, use_cache=False, **kw).last_hidden_state

    detected = hidden()
    assert torch.equal(hidden(cu_seq_lens_q=cu, cu_seq_lens_k=cu), detected)
    whole = torch.tensor([0, ids.shape[1]], dtype=torch.int32)  # a layout that disagrees with the positions
    assert not torch.equal(hidden(cu_seq_lens_q=whole, cu_seq_lens_k=whole), detected)  # so the given one is used
    with pytest.raises(UsageError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        hidden(cu_seq_lens_q=cu, cu_seq_lens_k=whole)


def test_packed_selected_logprobs_compile_fullgraph_with_the_eager_bits():
    model = patched("triton_bf16")
    ids = torch.cat(sequences())[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: selected_logprobs(model, i, cu_seqlens=cu), backend="aot_eager",
                             fullgraph=True)  # raises on a graph break
    with torch.no_grad():
        assert torch.equal(compiled(ids), selected_logprobs(model, ids, cu_seqlens=cu))


@pytest.mark.gpu
def test_packed_selected_logprobs_compile_with_inductor_on_the_gpu():
    # Inductor lowers searchsorted on CUDA itself, and could not take a sliced view as the boundaries
    # (NotImplementedError: SliceView at the H200's 1x8192 benchmark); the CPU's aot_eager never lowers it.
    model = patched("triton_bf16").cuda()
    ids = torch.cat(sequences())[None].cuda()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: selected_logprobs(model, i, cu_seqlens=cu), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids), selected_logprobs(model, ids, cu_seqlens=cu))
