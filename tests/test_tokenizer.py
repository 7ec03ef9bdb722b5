"""Chat-template tokenization: template token ids, the recorded Open-Jev workload counts, split encoding exactness."""

from __future__ import annotations

import pytest

from reference.data import open_jev_workloads
from reference.prompts import candidate_prompts, compile_records
from reference.request import validate_request
from reference.tokenizer import GENERATION_SUFFIX, PromptTokenizer, chat_text, default_prompt_tokenizer, load_tokenizer

# <|im_start|> user \n  ...  <|im_end|> \n <|im_start|> assistant \n <think> \n\n </think> \n\n
TEMPLATE_PREFIX_IDS = [248045, 846, 198]
TEMPLATE_SUFFIX_IDS = [248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return default_prompt_tokenizer()


def workload_plan(tokenizer: PromptTokenizer, request: dict) -> tuple[int, list[int]]:
    """(state tokens, per-candidate token counts) of a request: the bookkeeping of the recorded workloads."""
    records = compile_records(validate_request(request, model_id="Qwen/Qwen3.8-27B"))
    contents = [prompt for record in records for prompt in candidate_prompts(record)]
    return tokenizer.count_tokens(records[0].state_text), [len(ids) for ids in tokenizer.encode_prompts(contents)]


def test_template_text():
    assert chat_text("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert GENERATION_SUFFIX == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_template_token_ids(tokenizer):
    ids = tokenizer.encode_prompts(["Context:\nx"])[0]
    assert ids[:3] == TEMPLATE_PREFIX_IDS
    assert ids[-9:] == TEMPLATE_SUFFIX_IDS
    raw = load_tokenizer()
    assert raw.decode(ids) == chat_text("Context:\nx")
    assert [raw.decode([i]) for i in TEMPLATE_SUFFIX_IDS[5:8]] == ["<think>", "\n\n", "</think>"]


def test_drone_counts(tokenizer):
    state_tokens, counts = workload_plan(tokenizer, open_jev_workloads()["drone"]["request"])
    assert state_tokens == 83
    assert counts == [149, 146, 147, 132, 134, 132, 131]
    assert sum(counts) == 971


@pytest.mark.parametrize("workload_id", sorted(open_jev_workloads()))
def test_recorded_workload_counts(tokenizer, workload_id):
    """Every recorded count of every workload (taken with Open-Jev-2B's Qwen3.5 HF tokenizer) is reproduced."""
    workload = open_jev_workloads()[workload_id]
    state_tokens, counts = workload_plan(tokenizer, workload["request"])
    assert state_tokens == workload["state_tokens"]
    assert counts == workload["candidate_input_tokens"]
    assert len(counts) == workload["candidate_sequences"]
    assert sum(counts) == workload["logical_input_tokens"]
    assert max(counts) == workload["max_candidate_input_tokens"]
    assert len(workload["request"]["questions"]) == workload["question_count"]


TRICKY_CONTENTS = [
    "Context:\nplain",
    "",
    "\u0301 starts with a combining accent and ends with one e\u0301",
    "NFD cafe\u0301 vs NFC café, Å vs A\u030a",
    "holds <|im_end|> and <|im_start|>assistant and <think></think> inside",
    "ends with a partial special <|im_",
    "ends with <",
    "<|im_end|>",
    "windows\r\nline\r\n",
    "  spaces around  \n\n",
    "emoji 👩‍👩‍👧 and CJK 日本語のテキスト and Arabic مرحبا",
    "user\n",
    "\n",
]


@pytest.mark.parametrize("content", TRICKY_CONTENTS)
def test_split_encoding_equals_whole_string_encoding(tokenizer, content):
    assert tokenizer.encode_prompts([content]) == [load_tokenizer().encode(chat_text(content))]


def test_nfc_normalisation(tokenizer):
    decomposed, composed = tokenizer.encode_prompts(["cafe\u0301", "caf\u00e9"])
    assert decomposed == composed


def test_batch_keeps_order(tokenizer):
    contents = ["Context:\nfirst", "Context:\nsecond one", "Context:\nthird"]
    assert tokenizer.encode_prompts(contents) == [tokenizer.encode_prompts([c])[0] for c in contents]
    assert tokenizer.encode_prompts([]) == []


def test_explicit_tokenizer_object():
    mine = PromptTokenizer(load_tokenizer())
    assert mine.encode_prompts(["Context:\nx"]) == default_prompt_tokenizer().encode_prompts(["Context:\nx"])
