"""ppo/data/tokenizer.py: the built-in char tokenizer and a local HF tokenizer dir built in tmp_path."""

from __future__ import annotations

import json

import pytest
import torch

from models.config import preset_config
from ppo.data.prompts import PromptDataset
from ppo.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_tokenizer

# a ChatML-style template like Qwen2's, exercising loops, conditionals and the generation prompt
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_char_tokenizer_round_trip_and_fits_tiny():
    tok = load_tokenizer("builtin:char")
    assert isinstance(tok, CharTokenizer) and isinstance(tok, Tokenizer)
    text = "Q: 12+34=?\nA:\t46 ~{}"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    cfg = preset_config("tiny")
    assert tok.vocab_size <= cfg.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (cfg.pad_token_id, cfg.bos_token_id,
                                                                      cfg.eos_token_id)
    assert tok.decode(ids + [tok.eos_token_id]) == text + "</s>"
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    assert tok.encode("é") == [3]  # unknown -> <unk>
    # ids of a larger model vocab (the 32k benchmark shapes) and tensor elements decode to nothing / their text
    assert tok.decode([-1, 5, tok.vocab_size, 31999, 1]) == tok.decode([5]) + "<s>"
    assert tok.decode(torch.tensor([5, 2, 40000]), skip_special_tokens=True) == tok.decode([5])
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _make_hf_dir(tmp_path, *, template=CHATML, pad=True, eos_dict=True, **extra):
    from tokenizers import Tokenizer as T
    from tokenizers import models, pre_tokenizers, trainers

    tok = T(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<pad>"] if pad else [])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the sum of 12 and 34 is 46", "user assistant system"] * 20, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    eos = {"content": "<|im_end|>", "special": True} if eos_dict else "<|im_end|>"
    cfg = {"eos_token": eos, "bos_token": None,
           "chat_template": template, **extra}
    if pad:
        cfg["pad_token"] = "<pad>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def test_hf_tokenizer_dir(tmp_path):
    raw = _make_hf_dir(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_token_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_token_id == raw.token_to_id("<pad>")
    assert tok.bos_token_id is None and not tok.add_bos
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    text = "the sum of 12 and 34 is 46"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "hello world"]) == [tok.encode(text), tok.encode("hello world")]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode(rendered)
    assert ids[0] == raw.token_to_id("<|im_start|>")  # special tokens in the rendered text stay single ids
    assert ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=True).count("<|im_start|>") == 0


def test_hf_tokenizer_template_helpers_and_errors(tmp_path):
    tpl = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
           "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m | tojson }}{% endfor %}")
    _make_hf_dir(tmp_path, template=[{"name": "default", "template": tpl}, {"name": "tool_use", "template": "x"}],
                 pad=False)
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.pad_token_id == tok.eos_token_id  # no pad token: eos pads
    assert tok.apply_chat_template([{"role": "user", "content": "a<b"}]) == '{"role": "user", "content": "a<b"}'
    with pytest.raises(TokenizerError, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_hf_tokenizer_add_bos(tmp_path):
    _make_hf_dir(tmp_path, bos_token="<|endoftext|>", add_bos_token=True)
    tok = load_tokenizer(str(tmp_path))
    assert tok.add_bos and tok.bos_token_id is not None
    # plain-text prompts get bos (as transformers' tokenizer(text) would); templated ones keep the template's
    ds = PromptDataset.from_rows([{"prompt": "hello", "answer": "1"},
                                  {"prompt": [{"role": "user", "content": "hello"}], "answer": "1"}], tokenizer=tok)
    assert ds[0].prompt_ids == [tok.bos_token_id] + tok.encode("hello")
    assert ds[1].prompt_ids == tok.encode(ds[1].prompt_text) and ds[1].prompt_ids[0] != tok.bos_token_id


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="builtin:char"):
        load_tokenizer("builtin:bpe")
    with pytest.raises(TokenizerError, match="not a local directory"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("")
    _make_hf_dir(tmp_path, template=None)
    with pytest.raises(TokenizerError, match="no chat_template"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


# Qwen2.5's template shape: whitespace control, a tools branch with tojson, loop.first, attribute access
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Llama-3-style: bos_token variable, raise_exception, a default date, trim_blocks-sensitive newlines
LLAMA3 = (
    "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n"
    "{%- endif %}\n{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n"
    "{{- \"<|im_start|>system\\n\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|im_end|>\" }}\n{% for message in messages %}\n"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n\\n' + message['content'] | trim + '<|im_end|>' }}\n"
    "{% endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n\\n' }}\n{%- endif %}\n"
)


@pytest.mark.parametrize("template", [CHATML, QWEN25, LLAMA3])
def test_chat_template_rendering_matches_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    _make_hf_dir(tmp_path, template=template, bos_token="<|endoftext|>", eos_dict=False)
    ours = load_tokenizer(str(tmp_path))
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    conversations = [
        [{"role": "user", "content": "What is 12+34?"}],
        [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "hello world"},
         {"role": "assistant", "content": "the sum"}, {"role": "user", "content": "and 46?"}],
    ]
    for msgs in conversations:
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(msgs, add_generation_prompt=gen)
            assert got == want
            assert ours.encode(got) == ref.encode(want, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "add", "description": "a<b", "parameters": {}}}]
    want = ref.apply_chat_template(conversations[0], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversations[0], tools=tools) == want


def test_tokenizer_comes_from_model_path(tmp_path):
    """model.tokenizer=auto (the default): model.path's tokenizer when the folder has one."""
    from launcher.config.load import load_config
    from ppo.data.tokenizer import resolve_tokenizer
    from tests.ppo.world import train_state

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert resolve_tokenizer("auto", str(model_dir)) == "builtin:char"  # weights without a tokenizer
    _make_hf_dir(model_dir)
    assert resolve_tokenizer("auto", str(model_dir)) == str(model_dir)
    assert resolve_tokenizer("auto", None) == "builtin:char"
    assert resolve_tokenizer("builtin:char", str(model_dir)) == "builtin:char"  # set otherwise: kept
    cfg = load_config(None, [f"model.path={model_dir}", "data.task_size=64"])
    state = train_state(cfg, tmp_path)
    assert isinstance(state.tokenizer, HFTokenizer) and state.tokenizer.path == str(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", "model.tokenizer=builtin:char", "data.task_size=64"])
    assert isinstance(train_state(cfg, tmp_path).tokenizer, CharTokenizer)
