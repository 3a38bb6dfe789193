"""Incremental chat-template tokenization for multi-turn episodes.

Generated tokens are never re-tokenized: the conversation's token list is the initial prompt, then for
each turn the engine's generated ids verbatim, then the template text that closes the assistant turn
and carries the next observation up to the next generation prompt. That text is found as the string
difference between two renderings of the chat template (with and without the new observation), which
requires a prefix-stable template (ChatML and most others are; a template that rewrites earlier turns
raises `ValueError`). If the generated ids already end with the stop token that the template writes
after the assistant turn, that token is not added a second time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, str]


class ChatTokens:
    """Wraps a HF tokenizer that has a `chat_template`."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.stop_token_ids = self._stop_ids()

    def _stop_ids(self) -> tuple[int, ...]:
        ids = []
        for tok in ("<|im_end|>", self.tokenizer.eos_token):
            if tok is None:
                continue
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid not in ids:
                ids.append(tid)
        return tuple(ids)

    def render(
        self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool, tools: list[Any] | None = None
    ) -> str:
        """The template's text of `messages` (with `tools` when given: templates that render them)."""
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The ids of `messages` followed by the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def continuation_ids(self, history: list[Message], generated: list[int], observation: str) -> list[int]:
        """Ids that follow the generated ids: end of the assistant turn, the observation, next prompt.

        `history` is the conversation before this assistant turn; `generated` the engine's ids.
        """
        stop_at_end = self.ends_with_stop(generated)
        assistant = self.assistant_content(generated)
        base = self.render(history, generation_prompt=True) + assistant
        full = self.render(
            [*history, {"role": "assistant", "content": assistant}, {"role": "user", "content": observation}],
            generation_prompt=True,
        )
        if not full.startswith(base):
            raise ValueError("chat template is not prefix-stable: it rewrites an earlier turn")
        suffix = full[len(base) :]
        if stop_at_end:
            stop_text = self.tokenizer.convert_ids_to_tokens(generated[-1])
            if suffix.startswith(stop_text):
                suffix = suffix[len(stop_text) :]
        return self.encode(suffix)

    def ends_with_stop(self, generated: list[int]) -> bool:
        return bool(generated) and generated[-1] in self.stop_token_ids

    def assistant_content(self, generated: list[int]) -> str:
        """The assistant message content recorded in the history (stop token removed, nothing else)."""
        body = generated[:-1] if self.ends_with_stop(generated) else generated
        return self.decode(body, skip_special=False)

    def assistant_text(self, generated: list[int]) -> str:
        """The text of a generated turn as the env sees it (special tokens removed)."""
        return self.decode(generated, skip_special=True)
