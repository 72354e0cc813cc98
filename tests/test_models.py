"""The paged decoder against a dense, cache-free float32 forward of the same weights, the block
manager's bookkeeping, and weights imported from transformers against transformers' own
logits."""

import operator
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from pagedfuse.models import (
    PRESETS,
    PagedDecoder,
    PagedKVCache,
    dense_reference_logits,
    from_transformers,
    generate,
    preset,
)
from pagedfuse.numerics import max_rel_err

BATCH, PROMPT_LEN, STEPS, BLOCK_SIZE = 2, 6, 4, 4  # 10 tokens over 3 blocks per sequence


def _prompts(vocab: int, batch: int = BATCH, length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(7))


def _run_against_reference(config, reference_model=None):
    """Greedy generation with the paged model; the dense reference on the same tokens."""
    model = PagedDecoder(config, seed=3)
    gen = generate(model, _prompts(config.vocab_size), STEPS)
    ref = dense_reference_logits(reference_model or model, gen.tokens[:, :-1])
    assert gen.logits.shape == ref.shape == (BATCH, PROMPT_LEN + STEPS, config.vocab_size)
    return gen, ref


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("kv_cache, tol", [("fp32", 1e-4), ("bf16", 3e-2)])
@pytest.mark.parametrize("name", list(PRESETS))
def test_paged_logits_match_dense_reference(name, kv_cache, tol, layout):
    config = preset(name, kv_cache=kv_cache, layout=layout, block_size=BLOCK_SIZE)
    gen, ref = _run_against_reference(config)
    assert gen.logits.dtype == config.activation_dtype
    assert max_rel_err(gen.logits, ref) <= tol
    assert torch.equal(gen.tokens[:, PROMPT_LEN:], gen.logits[:, PROMPT_LEN - 1:].argmax(-1))


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_int8_cache_close_to_unquantized_model(name, layout):
    config = preset(name, kv_cache="int8", layout=layout, block_size=BLOCK_SIZE)
    unquantized = PagedDecoder(preset(name, block_size=BLOCK_SIZE), seed=3)
    gen, ref = _run_against_reference(config, reference_model=unquantized)
    err = max_rel_err(gen.logits, ref)
    assert 0 < err <= 5e-2  # > 0: the cache really is quantized
    top1 = (gen.logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert top1 >= 0.9


@pytest.mark.parametrize("kv_cache, tol", [("fp32", 1e-4), ("int8", 5e-2)])
@pytest.mark.parametrize("name", list(PRESETS))
def test_alibi_matches_dense_reference(name, kv_cache, tol):
    config = preset(name, alibi=True, kv_cache=kv_cache, block_size=BLOCK_SIZE)
    unquantized = PagedDecoder(preset(name, alibi=True, block_size=BLOCK_SIZE), seed=3)
    gen, ref = _run_against_reference(config, reference_model=unquantized)
    assert max_rel_err(gen.logits, ref) <= tol
    rope_ref = dense_reference_logits(PagedDecoder(preset(name, block_size=BLOCK_SIZE), seed=3),
                                      gen.tokens[:, :-1])
    assert max_rel_err(rope_ref, ref) > 1e-2  # ALiBi really replaces RoPE


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_int8_cache_storage(layout):
    config = preset("tinyllama", kv_cache="int8", layout=layout, block_size=BLOCK_SIZE)
    cache = PagedKVCache(config, batch=2, max_len=9)
    pages, scales = (3 * 2, BLOCK_SIZE, 4, 64), (3 * 2, BLOCK_SIZE, 4)
    if layout == "hnd":
        pages, scales = (6, 4, BLOCK_SIZE, 64), (6, 4, BLOCK_SIZE)
    for layer in cache.layers:
        assert layer.key.dtype == layer.value.dtype == torch.int8
        assert layer.key.shape == layer.value.shape == pages
        assert layer.key_scale.dtype == layer.value_scale.dtype == torch.float32
        assert layer.key_scale.shape == layer.value_scale.shape == scales


def test_block_manager_metadata():
    config = preset("llama3", block_size=BLOCK_SIZE)
    cache = PagedKVCache(config, batch=3, max_len=11, seed=5)
    prefill = cache.append(_prompts(config.vocab_size, batch=3, length=5))
    assert prefill.block_table.shape == (3, 3) and prefill.block_table.dtype == torch.int32
    assert prefill.seq_lens.tolist() == [5, 5, 5]
    assert prefill.positions.tolist() == [list(range(5))] * 3
    for _ in range(3):
        decode = cache.append(torch.tensor([[1], [2], [3]]))
    assert decode.block_table.shape == (3, 3)  # width fixed: every decode step is one graph
    assert decode.seq_lens.tolist() == [8, 8, 8]
    assert decode.positions.tolist() == [[7]] * 3
    used = [row[:2] for row in decode.block_table.tolist()]
    flat = [block for row in used for block in row]
    assert len(set(flat)) == len(flat)  # no block shared between sequences
    assert flat != sorted(flat)  # shuffled: not an identity table
    expected_slots = [row[7 // BLOCK_SIZE] * BLOCK_SIZE + 7 % BLOCK_SIZE for row in used]
    assert decode.slot_mapping.tolist() == expected_slots
    prefill_slots = prefill.slot_mapping.view(3, 5).tolist()
    assert prefill_slots[1] == [used[1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                for p in range(5)]
    with pytest.raises(ValueError, match="^tokens: sequence 0 would hold 13 tokens"):
        cache.append(torch.zeros(3, 5, dtype=torch.int64))


@pytest.mark.parametrize("kv_cache", ["fp32", "int8"])
def test_right_padded_prompts_generate_as_each_prompt_alone(kv_cache):
    """Prompts of lengths 3, 6 and 4 in one padded batch: each row's logits and tokens are
    those of the prompt run alone, though its padding was written to the cache."""
    config = preset("tinyllama", kv_cache=kv_cache, block_size=BLOCK_SIZE)
    model = PagedDecoder(config, seed=3)
    lengths = [3, 6, 4]
    padded = _prompts(config.vocab_size, batch=3, length=6)
    together = generate(model, padded, STEPS, prompt_lens=lengths)
    for row, length in enumerate(lengths):
        alone = generate(model, padded[row:row + 1, :length], STEPS)
        assert torch.equal(together.tokens[row, 6:], alone.tokens[0, length:])
        torch.testing.assert_close(together.logits[row, 6:], alone.logits[0, length:],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together.logits[row, :length], alone.logits[0, :length],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="^lengths: "):
        model.new_cache(2, 8).rewind([1, 2])


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="^preset: 'gpt5'"):
        preset("gpt5")
    with pytest.raises(ValueError, match="^kv_cache: 'fp8'"):
        preset("tinyllama", kv_cache="fp8")
    with pytest.raises(ValueError, match="^layout: 'nchw'"):
        preset("tinyllama", layout="nchw")
    with pytest.raises(ValueError, match="^value_cache: 'bf16' with a fp32 K cache"):
        preset("tinyllama", value_cache="bf16")
    with pytest.raises(ValueError, match="^value_cache: 'fp8'"):
        preset("tinyllama", kv_cache="int8", value_cache="fp8")
    assert preset("tinyllama", kv_cache="int8", dtype=torch.bfloat16).cache_dtype == torch.int8


@pytest.mark.parametrize("kv_cache, value_cache, k_dtype, v_dtype, attn_dtype", [
    ("fp32", None, torch.float32, torch.float32, torch.float32),
    ("bf16", None, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ("int8", None, torch.int8, torch.int8, torch.float32),
    ("int8", "int8", torch.int8, torch.int8, torch.float32),
    ("int8", "bf16", torch.int8, torch.bfloat16, torch.bfloat16),
])
def test_cache_kinds_set_page_and_attention_dtypes(kv_cache, value_cache, k_dtype, v_dtype,
                                                   attn_dtype):
    config = preset("tinyllama", kv_cache=kv_cache, value_cache=value_cache, dtype=torch.float32,
                    block_size=BLOCK_SIZE)
    assert (config.cache_dtype, config.value_cache_dtype) == (k_dtype, v_dtype)
    assert (config.attention_dtype, config.activation_dtype) == (attn_dtype, torch.float32)
    layer = PagedKVCache(config, batch=2, max_len=9).layers[0]
    assert (layer.key.dtype, layer.value.dtype) == (k_dtype, v_dtype)
    assert (layer.key_scale is None, layer.value_scale is None) == \
        (k_dtype != torch.int8, v_dtype != torch.int8)


@pytest.mark.parametrize("kv_cache, value_cache, tol", [
    ("bf16", None, 3e-2), ("int8", "bf16", 5e-2)])
def test_fp32_weights_over_a_lower_precision_cache(kv_cache, value_cache, tol):
    """fp32 weights and activations, attention in the cache's bf16: the logits stay fp32 and
    close to the dense fp32 model, but not equal to it (the cache really is lower precision)."""
    config = preset("tinyllama", kv_cache=kv_cache, value_cache=value_cache,
                    dtype=torch.float32, block_size=BLOCK_SIZE)
    gen, ref = _run_against_reference(config)
    assert gen.logits.dtype == torch.float32
    assert 1e-5 < max_rel_err(gen.logits, ref) <= tol


@pytest.mark.parametrize("kv_cache", ["fp32", "int8"])
def test_compiled_graphs_hold_the_paged_attention_and_stay_dynamic(kv_cache):
    """One graph for prefill, one for every decode step; then a new batch size and prompt
    length compile once more (automatic dynamic) and a third shape reuses those graphs."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    config = preset("tinyllama", kv_cache=kv_cache, block_size=BLOCK_SIZE)
    model = PagedDecoder(config, seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture)
    for batch, prompt_len, expected_graphs in ((2, 6, 2), (3, 9, 4), (5, 13, 4)):
        prompts = _prompts(config.vocab_size, batch, prompt_len)
        eager = generate(model, prompts, STEPS)
        traced = generate(model, prompts, STEPS, forward=compiled)
        torch.testing.assert_close(traced.logits, eager.logits, rtol=1e-5, atol=1e-5)
        assert len(graphs) == expected_graphs
    writes_per_layer = 4 if kv_cache == "int8" else 2  # K, V (and their scales)
    for gm in graphs:
        calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
        assert calls[F.scaled_dot_product_attention] == config.num_layers
        assert calls[F.linear] == 7 * config.num_layers + 1
        setitems = [n for n in gm.graph.nodes if n.target is operator.setitem]
        assert len(setitems) == writes_per_layer * config.num_layers


def _hf_model(kind: str, **changes):
    """A small transformers model with GQA (6 query over 2 KV heads), head_dim apart from
    hidden / heads, an unusual RoPE theta and RMSNorm eps, and weights large enough that the
    logits are far from flat (the default init's are nearly uniform)."""
    transformers = pytest.importorskip("transformers", minversion="5.12")
    fields = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=300,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                  rms_norm_eps=1e-5, tie_word_embeddings=True)
    if kind == "mistral":
        fields["sliding_window"] = None
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}
    config = config_class[kind](**{**fields, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.normal_(1.0, 0.1)
    return model.eval()


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("kind, tied", [("llama", True), ("llama", False), ("mistral", True)])
def test_imported_weights_give_transformers_logits(kind, tied, layout):
    hf = _hf_model(kind, tie_word_embeddings=tied)
    model = from_transformers(hf, layout=layout, block_size=BLOCK_SIZE)
    assert (model.config.num_q_heads, model.config.num_kv_heads, model.config.head_dim) == \
        (6, 2, 32)
    assert (model.config.rope_theta, model.config.norm_eps) == (5e4, 1e-5)
    assert (model.lm_head is None) == tied
    gen = generate(model, _prompts(300), STEPS)  # prefill, then decode through the cache
    with torch.no_grad():
        expected = hf(gen.tokens[:, :-1]).logits
    assert max_rel_err(gen.logits, expected) <= 1e-5
    untied = hf.lm_head.weight is not hf.model.embed_tokens.weight
    assert untied != tied


@pytest.mark.parametrize("kv_cache, value_cache, tol", [
    ("bf16", None, 3e-2), ("int8", None, 5e-2), ("int8", "bf16", 5e-2)])
def test_imported_weights_on_every_cache_kind(kv_cache, value_cache, tol):
    hf = _hf_model("llama")
    model = from_transformers(hf, kv_cache=kv_cache, value_cache=value_cache,
                              dtype=torch.float32, block_size=BLOCK_SIZE)
    gen = generate(model, _prompts(300), STEPS)
    with torch.no_grad():
        expected = hf(gen.tokens[:, :-1]).logits
    assert 1e-5 < max_rel_err(gen.logits, expected) <= tol


@pytest.mark.parametrize("changes, reason", [
    (dict(attention_bias=True), "^hf_config: attention_bias is set"),
    (dict(hidden_act="gelu"), "^hf_config: hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "^hf_config: rope_parameters .*'linear'"),
])
def test_import_refuses_what_the_decoder_cannot_compute(changes, reason):
    with pytest.raises(ValueError, match=reason):
        from_transformers(_hf_model("llama", **changes))


def test_import_refuses_other_architectures():
    transformers = pytest.importorskip("transformers", minversion="5.12")
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1,
                                      intermediate_size=64, vocab_size=100)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="^hf_config: model_type 'qwen2' is not one of"):
        from_transformers(hf)
