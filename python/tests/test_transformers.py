"""flashc.transformers on a tiny randomly initialized Llama (built from a LlamaConfig: no downloads) against
transformers' own "sdpa" implementation, fp32 on the CPU: logits with left and right padding, gradients of a loss
w.r.t. every parameter, greedy generation with the dynamic and the static cache; and the mask and attention
functions on their own against transformers' sdpa mask and attention function, case by case.

fp32 rule (CONVENTIONS.md): relative error <= 1e-5; generated tokens identical.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashc.transformers as ft  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

sdpa_attention_forward = pytest.importorskip("transformers.integrations.sdpa_attention").sdpa_attention_forward


@pytest.fixture
def gen(request):
    import numpy as np

    seed = int(os.environ.get("FLASHC_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print("FLASHC_TEST_SEED=%d (%s)" % (seed, request.node.name))
    torch.manual_seed(seed)
    return seed


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


VOCAB = 96


def tiny_config(**kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return LlamaConfig(**cfg)


def model_pair(**kw):
    """The same random weights under attn_implementation 'sdpa' and flashc's, in fp32, eval mode."""
    ref = AutoModelForCausalLM.from_config(tiny_config(**kw), attn_implementation="sdpa")
    fc = AutoModelForCausalLM.from_config(tiny_config(**kw), attn_implementation=ft.register())
    fc.load_state_dict(ref.state_dict())
    return ref.float().eval(), fc.float().eval()


def batch(b=3, n=20, padding="left"):
    """input_ids and attention_mask with sequences of different lengths (one unpadded), padded on one side."""
    ids = torch.randint(3, VOCAB, (b, n))
    lengths = torch.tensor([n] + [int(x) for x in torch.randint(4, n, (b - 1,))])
    j = torch.arange(n)
    if padding == "left":
        mask = j >= n - lengths[:, None]
    elif padding == "right":
        mask = j < lengths[:, None]
    else:
        mask = torch.ones(b, n, dtype=torch.bool)
    ids = ids.masked_fill(~mask, 0)
    return ids, mask.long()


def test_register_name():
    name = ft.register()
    assert name == ft.NAME == "fc_attention" and "flash" not in name
    assert ft.register() == name  # again: harmless
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[name] is ft.attention_forward
    assert AttentionMaskInterface._global_mapping[name] is ft.mask_function
    for bad in ("flashc", "my/kernel", "sdpa_flashc"):
        with pytest.raises(ValueError, match="treats"):
            ft.register(bad)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits(padding, gen):
    ref, fc = model_pair()
    ids, mask = batch(padding=padding)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = fc(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions' logits are not compared: they are nobody's output
    assert rel_err(got[real], want[real]) <= 1e-5, rel_err(got[real], want[real])


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_gradients(padding, gen):
    """Training step: a language-model loss on the real tokens, in train mode (attention_dropout 0), and the
    gradient of every parameter."""
    ref, fc = model_pair()
    ids, mask = batch(padding=padding)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ref, fc):
        model.train()
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) <= 1e-5, "%s: %.3g" % (n, rel_err(grads[1][n], grads[0][n]))


def test_training_step_compiled(gen):
    """A right-padded training step compiled with fullgraph=True (the mask function runs inside the graph, so the
    padding mask is kept without looking at it): the loss and every gradient of the eager sdpa model."""
    ref, fc = model_pair()
    ids, mask = batch(padding="right")
    labels = ids.masked_fill(mask == 0, -100)
    step = torch.compile(lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss, fullgraph=True,
                         backend="aot_eager")
    fc.train()
    ref.train()
    loss = step(fc)
    loss.backward()
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    assert rel_err(loss.detach(), want.detach()) <= 1e-5
    for (n, a), (_, b) in zip(fc.named_parameters(), ref.named_parameters()):
        assert rel_err(a.grad, b.grad) <= 1e-5, n


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_greedy(cache, gen):
    """Greedy generation from a left-padded batch: the same tokens as sdpa, and per-step scores within fp32
    rounding. The static cache is longer than the sequences, so its unfilled slots must be left out."""
    ref, fc = model_pair()
    ids, mask = batch(b=3, n=12, padding="left")
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        got = fc.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        assert rel_err(a, b) <= 1e-5, "step %d: %.3g" % (step, rel_err(a, b))


def test_generate_static_compiled(gen):
    """generate() with a static cache compiles the decode step (here forced on the CPU, fullgraph=True): the mask
    and attention functions trace without a graph break and give sdpa's tokens."""
    from transformers.generation.configuration_utils import CompileConfig

    cc = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    if not hasattr(cc, "_compile_all_devices"):
        pytest.skip("this transformers compiles generate() on accelerators only")
    cc._compile_all_devices = True
    ref, fc = model_pair()
    ids, mask = batch(b=2, n=8, padding="left")
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        got = fc.generate(input_ids=ids, attention_mask=mask, compile_config=cc, **kw)
    assert torch.equal(got, want)


def test_static_and_dynamic_agree(gen):
    _, fc = model_pair()
    ids, mask = batch(b=2, n=9, padding="left")
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        dyn = fc.generate(input_ids=ids, attention_mask=mask, **kw)
        st = fc.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **kw)
    assert torch.equal(dyn, st)


def other_pair(config_name, ref_impl, **kw):
    """A tiny model of another architecture (skipped where this transformers lacks it), same weights twice."""
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        pytest.skip("transformers without %s" % config_name)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    ref = AutoModelForCausalLM.from_config(config_cls(**cfg), attn_implementation=ref_impl)
    fc = AutoModelForCausalLM.from_config(config_cls(**cfg), attn_implementation=ft.register())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "sinks" in n:
                p.normal_()  # initialized to 0; make them matter
    fc.load_state_dict(ref.state_dict())
    return ref.float().eval(), fc.float().eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_window_model(cache, gen):
    """Mistral (every layer a 6-token sliding window, shorter than the sequences): logits with left padding and
    greedy generation, where the dynamic cache drops its oldest keys (kv_offset > 0)."""
    ref, fc = other_pair("MistralConfig", "sdpa", sliding_window=6)
    ids, mask = batch(b=3, n=14, padding="left")
    with torch.no_grad():
        got = fc(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], want[real]) <= 1e-5
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
              eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        got = fc.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        assert rel_err(a, b) <= 1e-5


def test_sinks_and_mixed_layers_model(gen):
    """GPT-OSS (attention sinks, a sliding-window layer and a full layer, mixture of experts) against transformers'
    eager implementation (its only other one): logits with left padding, the gradient of every parameter (the sinks
    included) with right padding, greedy generation."""
    ref, fc = other_pair("GptOssConfig", "eager", intermediate_size=64, head_dim=16, sliding_window=6,
                         num_local_experts=4, num_experts_per_tok=2,
                         layer_types=["sliding_attention", "full_attention"])
    ids, mask = batch(b=3, n=14, padding="left")
    with torch.no_grad():
        got = fc(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], want[real]) <= 1e-5
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(fc.generate(input_ids=ids, attention_mask=mask, **kw),
                           ref.generate(input_ids=ids, attention_mask=mask, **kw))
    ids, mask = batch(b=3, n=14, padding="right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ref, fc):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("sinks" in n for n in grads[0])
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) <= 1e-5, "%s: %.3g" % (n, rel_err(grads[1][n], grads[0][n]))


def test_dropout_training(gen):
    """attention_dropout in train mode runs fused dropout, seeded from torch's generator: the same seed gives the same
    loss and gradients, another call another mask; eval mode drops nothing and matches the eager model."""
    ref, fc = model_pair(attention_dropout=0.3)
    ids, mask = batch(padding="none")
    fc.train()

    def step(seed):
        fc.zero_grad()
        torch.manual_seed(seed)
        loss = fc(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in fc.parameters() if p.grad is not None]

    l1, g1 = step(5)
    l2, g2 = step(5)
    l3, _ = step(6)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not torch.equal(l1, l3)
    fc.eval()
    ref.eval()
    with torch.no_grad():
        a = fc(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    assert rel_err(a, b) <= 1e-4


# ---- the mask and attention functions on their own, against transformers' sdpa mask + sdpa attention ----------
class _Module(torch.nn.Module):
    def __init__(self, groups, causal=True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = causal


CASES = [
    # name, mask ("causal", "bidirectional", or a sliding window: "causal:w", "bidirectional:w"), Nq, kv_length,
    # q_offset, kv_offset, padding. kv_offset > 0: a sliding-window cache that has dropped its oldest keys.
    ("prefill", "causal", 16, 16, 0, 0, "left"),
    ("prefill_right", "causal", 16, 16, 0, 0, "right"),
    ("prefill_nopad", "causal", 16, 16, 0, 0, None),
    ("chunk_after_cache", "causal", 5, 21, 16, 0, "left"),
    ("decode_dynamic", "causal", 1, 17, 16, 0, "left"),
    ("decode_static", "causal", 1, 40, 16, 0, "left"),
    ("prefill_static", "causal", 16, 40, 0, 0, "right"),
    ("decode_static_nopad", "causal", 1, 40, 16, 0, None),
    ("bidirectional", "bidirectional", 16, 16, 0, 0, "right"),
    ("bidirectional_left", "bidirectional", 16, 16, 0, 0, "left"),
    ("sliding_prefill", "causal:5", 16, 16, 0, 0, "left"),
    ("sliding_prefill_right", "causal:5", 16, 16, 0, 0, "right"),
    ("sliding_decode_dropped", "causal:5", 1, 5, 20, 16, "left"),
    ("sliding_chunk_dropped", "causal:5", 4, 8, 20, 16, "left"),
    ("sliding_static_not_full", "causal:8", 1, 8, 3, 0, "left"),
    ("sliding_bidirectional", "bidirectional:3", 16, 16, 0, 0, "right"),
]
# a static cache gives its offset as a tensor (a dynamic one as an int); the static cases run with both
OFFSET_CASES = [c + (False,) for c in CASES] + [c + (True,) for c in CASES if c[4] - c[5] + c[2] < c[3]
                                                 and c[1] == "causal"]


def hf_mask_function(kind):
    base, _, w = kind.partition(":")
    if not w:
        return (mu.causal_mask_function if base == "causal" else mu.bidirectional_mask_function), None
    if base == "causal":
        return mu.sliding_window_causal_mask_function(int(w)), int(w)
    return mu.sliding_window_bidirectional_mask_function(int(w)), int(w)


@pytest.mark.parametrize("name,kind,nq,kv_length,q_offset,kv_offset,padding,static_offset", OFFSET_CASES,
                         ids=[c[0] + ("_tensor_offset" if c[-1] else "") for c in OFFSET_CASES])
def test_mask_and_attention_functions(name, kind, nq, kv_length, q_offset, kv_offset, padding, static_offset, gen):
    """The cache geometry transformers gives each layer: kv_length key slots holding positions kv_offset .. (a static
    cache's capacity, or what a dynamic cache holds), queries at q_offset .. q_offset + Nq - 1, a 2-D padding mask
    over every position so far. The sdpa reference is transformers' own mask (sdpa_mask) and attention function;
    unfilled static slots hold NaN, which flashc must never read."""
    b, h, hkv, d = 3, 4, 2, 16
    filled = q_offset - kv_offset + nq  # key slots in use
    n_mask = q_offset + nq
    j = torch.arange(n_mask)
    lengths = torch.tensor([n_mask, max(n_mask - 5, 1), max(n_mask // 2, 1)])
    pad = None
    if padding == "left":
        pad = j >= n_mask - lengths[:, None]
    elif padding == "right":
        pad = j < lengths[:, None]
    q = torch.randn(b, h, nq, d)
    k = torch.randn(b, hkv, kv_length, d)
    v = torch.randn(b, hkv, kv_length, d)
    k[:, :, filled:] = float("nan")
    v[:, :, filled:] = float("nan")
    mfun, window = hf_mask_function(kind)
    offset = torch.tensor(q_offset) if static_offset else q_offset
    args = dict(batch_size=b, q_length=nq, kv_length=kv_length, q_offset=offset, kv_offset=kv_offset,
                mask_function=mfun, attention_mask=pad, local_size=window)
    fmask = ft.mask_function(device=torch.device("cpu"), **args)
    causal = kind.startswith("causal")
    assert isinstance(fmask, ft.KeyMask) and fmask.causal == causal
    # reference: NaN slots zeroed (sdpa reads them, with a mask that hides them; NaN * 0 would still be NaN)
    kr, vr = k.nan_to_num(0.0), v.nan_to_num(0.0)
    smask = mu.sdpa_mask(allow_is_causal_skip=False, device=torch.device("cpu"), **args)
    module = _Module(h // hkv, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rleaves = [t.double().clone().requires_grad_() for t in (q, kr, vr)]
    out, _ = ft.attention_forward(module, *leaves, fmask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, *rleaves, smask, scaling=0.25)
    assert out.shape == want.shape == (b, nq, h, d)
    assert rel_err(out, want) <= 1e-5, rel_err(out, want)
    do = torch.randn(out.shape)
    out.backward(do)
    want.backward(do.double())
    for gname, leaf, rleaf in zip(("dq", "dk", "dv"), leaves, rleaves):
        g = leaf.grad
        assert not g.isnan().any(), gname
        err = (g.double() - rleaf.grad).norm().item()
        assert err <= 1e-5 * rleaf.grad.norm().item() + 1e-6 * leaf.detach().nan_to_num(0.0).norm().item(), gname
        if gname != "dq":
            assert (g[:, :, filled:] == 0).all(), "%s past the filled slots" % gname


def test_mask_function_other_forms(gen):
    """Chunked attention (and any composition flashc does not know, such as a sliding window combined with another
    overlay): transformers' dense mask, which flashc's SDPA recognition refuses, naming what it runs."""
    b, h, n, d = 2, 2, 12, 16
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(b, dtype=torch.long))
    m = ft.mask_function(batch_size=b, q_length=n, kv_length=n, mask_function=chunked, attention_mask=None,
                         device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(m, torch.Tensor) and m.dtype == torch.bool
    q = torch.randn(b, h, n, d)
    with pytest.raises(ValueError, match="none of the supported forms"):
        ft.attention_forward(_Module(1), q, q, q, m)
    every_key = mu.padding_mask_function(torch.ones(b, n, dtype=torch.bool))
    overlaid = mu.and_masks(mu.sliding_window_causal_mask_function(4), every_key)
    m2 = ft.mask_function(batch_size=b, q_length=n, kv_length=n, mask_function=overlaid, attention_mask=None,
                          local_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(m2, torch.Tensor)  # not taken for a plain sliding window
    with pytest.raises(ValueError, match="none of the supported forms"):
        ft.attention_forward(_Module(1), q, q, q, m2)
    # a 4-D key padding mask passed as it is runs
    keys = torch.arange(n) < torch.tensor([n, 7])[:, None]
    dense = keys[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
    out, _ = ft.attention_forward(_Module(1), q, q, q, dense)
    want, _ = sdpa_attention_forward(_Module(1), q.double(), q.double(), q.double(), dense)
    assert rel_err(out, want) <= 1e-5


def test_attention_without_mask(gen):
    """No mask (a model that makes none): causal as the module says, top-left as transformers' sdpa does."""
    b, h, d = 2, 4, 16
    for nq, nk, causal in ((10, 10, True), (10, 10, False), (6, 10, True)):
        q, k, v = torch.randn(b, h, nq, d), torch.randn(b, 2, nk, d), torch.randn(b, 2, nk, d)
        out, _ = ft.attention_forward(_Module(2, causal), q, k, v, None)
        want, _ = sdpa_attention_forward(_Module(2, causal), q.double(), k.double(), v.double(), None)
        assert rel_err(out, want) <= 1e-5


# ---- on a GPU: bf16 against sdpa's own bf16 distance ------------------------------------------------------------
def _cuda_ready():
    import flashc

    return torch.cuda.is_available() and flashc.cuda_available()


@pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU visible to torch and a libflashc with the CUDA backend")
@pytest.mark.parametrize("padding", ["left", "right"])
def test_cuda_bf16_against_sdpa(padding, gen):
    """The tiny Llama (head dim 64) in bf16 on the GPU: logits at the real positions and every parameter's gradient
    of a training loss within twice the distance of transformers' own bf16 sdpa model to the fp32 sdpa model
    (gradients three times, CONVENTIONS.md's rule for 16-bit results), plus 1e-3; then greedy generation with the
    dynamic and the static cache (tokens finite and in the vocabulary, the static cache's unfilled slots left out)."""
    ref, fc = model_pair(hidden_size=256, intermediate_size=512)
    ref32 = ref.cuda()
    ref16 = AutoModelForCausalLM.from_config(tiny_config(hidden_size=256, intermediate_size=512),
                                             attn_implementation="sdpa")
    ref16.load_state_dict(ref.state_dict())
    ref16, fc16 = ref16.cuda().bfloat16().eval(), fc.cuda().bfloat16().eval()
    ids, mask = (t.cuda() for t in batch(b=3, n=40, padding=padding))
    real = mask.bool()[..., None]
    with torch.no_grad():
        want = ref32(input_ids=ids, attention_mask=mask).logits
        base = ((ref16(input_ids=ids, attention_mask=mask).logits.float() - want).abs() * real).max().item()
        err = ((fc16(input_ids=ids, attention_mask=mask).logits.float() - want).abs() * real).max().item()
    assert err <= 2 * base + 1e-3, "logits: max error %.3g > 2 x sdpa bf16's %.3g" % (err, base)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for m in (ref32, ref16, fc16):
        m.train()
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
        m.eval()
    for n in grads[0]:
        base = (grads[1][n] - grads[0][n]).abs().max().item()
        err = (grads[2][n] - grads[0][n]).abs().max().item()
        assert err <= 3 * base + 1e-3, "%s: max error %.3g > 3 x sdpa bf16's %.3g" % (n, err, base)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        for cache in ("dynamic", "static"):
            extra = {"cache_implementation": "static"} if cache == "static" else {}
            out = fc16.generate(input_ids=ids, attention_mask=mask, **kw, **extra)
            assert out.shape == (3, 48) and torch.equal(out[:, :40], ids)
            assert ((out[:, 40:] >= 0) & (out[:, 40:] < VOCAB)).all()
