"""Hugging Face models as users build them (``hf:`` specs and factories returning a stock model):
each decoder layer is its own block, only the hidden state crosses a layer cut (no mask, no rotary
table), tied weights count once, the adapted model computes what the stock one does, and its loss
is the library's own."""
from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import hf  # noqa: E402
from models.registry import build_model, loss_fn  # noqa: E402
from planner.coarsen import coarsen  # noqa: E402
from planner.errors import InvalidInputError  # noqa: E402
from planner.trace import trace  # noqa: E402

B, T = 2, 16
DECODER = "hidden_size=32,num_hidden_layers=3,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64," \
          "vocab_size=256,max_position_embeddings=64"
# family: (spec, layer path prefix, layers, blocks outside the layers, hidden size)
FAMILIES = {
    "gpt2": ("hf:gpt2?n_layer=3,n_embd=32,n_head=2,vocab_size=256,n_positions=64", "transformer.h.", 3, 5, 32),
    "llama": (f"hf:llama?{DECODER}", "model.layers.", 3, 3, 32),
    "mistral": (f"hf:mistral?{DECODER}", "model.layers.", 3, 3, 32),
    "qwen2": (f"hf:qwen2?{DECODER}", "model.layers.", 3, 3, 32),
    "bert": ("hf:bert?hidden_size=32,num_hidden_layers=3,num_attention_heads=2,intermediate_size=64,vocab_size=256,"
             "max_position_embeddings=64", "bert.encoder.layer.", 3, 2, 32),
}


def stock_gpt2():
    """A factory as a user writes it: a stock transformers model, no Stagewise code."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=256,
                                                                n_positions=64))


def _chain(spec: str):
    bundle = build_model(spec, batch=B, seq=T)
    graph = trace(bundle.module, bundle.example_inputs, name=spec)
    return bundle, graph, coarsen(graph)


@pytest.fixture(scope="module", params=list(FAMILIES))
def traced(request):
    return request.param, *_chain(FAMILIES[request.param][0])


def test_each_layer_is_its_own_block_and_only_the_hidden_state_crosses_its_cuts(traced):
    family, bundle, graph, chain = traced
    spec, prefix, layers, ends, hidden = FAMILIES[family]
    names = [b.name for b in chain.blocks]
    assert [n for n in names if n.startswith(prefix)] == [f"{prefix}{i}" for i in range(layers)]
    assert len(chain) == layers + ends, names
    for block in chain.blocks[:-1]:
        shapes = [graph.node(n).outputs[0].shape for n in block.boundary_nodes]
        # a [B, 1, T, T] mask or a [B, T, head_dim] rotary table would show here
        assert not any(len(s) >= 2 and s[-2:] == (T, T) for s in shapes), (block.name, shapes)
        if block.name.startswith(prefix):
            assert shapes == [(B, T, hidden)], (block.name, shapes)
            assert block.out_bytes == B * T * hidden * 4


def test_parameters_count_once_like_the_library_counts_them(traced):
    family, bundle, graph, chain = traced
    assert graph.param_count == chain.param_count == bundle.module.num_parameters()
    if family in ("gpt2", "bert"):  # the embedding is the LM head's weight: one entry, read by two blocks
        assert [t.nbytes for t in chain.tied_params] == [256 * FAMILIES[family][4] * 4]
        assert chain.tied_params[0].blocks == (0, len(chain) - 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_adapted_model_computes_what_the_stock_model_computes(family):
    bundle = build_model(FAMILIES[family][0], batch=B, seq=T, device="cpu")
    adapted = bundle.module.eval()
    stock_class = type(adapted)
    stock = stock_class._from_config(adapted.config.__class__.from_dict(adapted.config.to_dict()),
                                     attn_implementation="eager").eval()  # explicit mask tensors
    stock.load_state_dict(adapted.state_dict())  # the same names: adapting renamed nothing
    ids = bundle.example_inputs[0]
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids), stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_loss_is_the_librarys_own():
    bundle = build_model(FAMILIES["gpt2"][0], batch=B, seq=T, device="cpu")
    model, ids = bundle.module.eval(), bundle.example_inputs[0]
    assert loss_fn(bundle) is bundle.loss
    with torch.no_grad():
        logits = model(ids)
        own = type(model).forward(model, input_ids=ids, labels=ids).loss
    # the data gives each position's next token; the library shifts labels itself
    torch.testing.assert_close(bundle.loss(logits[:, :-1], ids[:, 1:]), own)

    masked = build_model(FAMILIES["bert"][0], batch=B, seq=T, device="cpu")
    model, ids = masked.module.eval(), masked.example_inputs[0]
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    with torch.no_grad():
        own = type(model).forward(model, input_ids=ids, labels=labels).loss
        torch.testing.assert_close(masked.loss(model(ids), labels), own)


def test_a_factory_returning_a_stock_model_is_adapted_the_same_way():
    from_factory = _chain("tests.unit.test_hf_models:stock_gpt2")
    from_spec = _chain(FAMILIES["gpt2"][0])
    assert [b.name for b in from_factory[2].blocks] == [b.name for b in from_spec[2].blocks]
    assert from_factory[1].fingerprint() == from_spec[1].fingerprint()
    assert from_factory[1].param_count == from_factory[0].module.num_parameters()  # still tied on meta


def test_a_config_json_or_model_folder_with_overrides(tmp_path):
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=256, max_position_embeddings=64,
                                     architectures=["BertForSequenceClassification"], num_labels=3)
    config.save_pretrained(tmp_path)
    bundle = build_model(f"hf:{tmp_path}", batch=B, seq=T)
    assert (bundle.family, bundle.vocab_or_classes) == ("classifier", 3)  # the file's architectures
    assert bundle.module.config.num_hidden_layers == 2
    bundle = build_model(f"hf:{tmp_path / 'config.json'}?num_hidden_layers=1,task=masked-lm", batch=B, seq=T)
    assert (bundle.family, bundle.vocab_or_classes) == ("lm", 256)
    assert bundle.module.config.num_hidden_layers == 1


def test_spec_grammar():
    parsed = hf.parse_hf_spec("hf:llama?hidden_size=64,rms_norm_eps=1e-5,tie_word_embeddings=true,"
                              "hidden_act=gelu,task=causal-lm")
    assert (parsed.source, parsed.is_path, parsed.task) == ("llama", False, "causal-lm")
    assert dict(parsed.overrides) == {"hidden_size": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                      "hidden_act": "gelu"}
    assert hf.parse_hf_spec("hf:some/folder").is_path and hf.parse_hf_spec("hf:config.json").is_path


@pytest.mark.parametrize("spec, needle", [
    ("hf:lama", "unknown model type 'lama'"),
    ("hf:llama?hidden=", "override 'hidden='"),
    ("hf:llama?num_hidden_layers", "override 'num_hidden_layers'"),
    ("hf:llama?hiden_size=64", "unknown config key 'hiden_size'"),
    ("hf:llama?task=translation", "task=translation"),
    ("hf:", "nothing after 'hf:'"),
    ("hf:/no/such/model/config.json", "no config file"),
    ("hf:gpt2?n_layer=1,n_embd=32,n_head=2,n_positions=8", "--seq 16"),
    (f"hf:mistral?{DECODER},sliding_window=8", "sliding window"),
])
def test_bad_specs_are_one_clear_error(spec, needle):
    with pytest.raises(InvalidInputError) as err:
        build_model(spec, batch=B, seq=T)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_bad_config_file_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="config file"):
        build_model(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-type"}))
    with pytest.raises(InvalidInputError, match="unknown model_type"):
        build_model(f"hf:{tmp_path}")


def test_without_transformers_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an import sees when it is not installed
    with pytest.raises(InvalidInputError, match=r"need the transformers library.*\[hf\]"):
        build_model("hf:gpt2?n_layer=1")
