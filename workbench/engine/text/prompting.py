"""`Prompting`: a decoder model's text side, from text and conversations to checked
prompt token ids (the tokenizer, the chat template, the context's limits)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.engine.runtime.kv_cache import ContextFullError
from workbench.engine.runtime.profiling import span
from workbench.engine.text.chat_template import render as render_chat
from workbench.engine.text.tokenizers.base import Tokenizer


class Prompting:
    """Tokens and prompts for `LLM` (which sets `tokenizer`, `chat_template`,
    `kv_cache_size` and `config`)."""

    tokenizer: Tokenizer
    chat_template: str
    kv_cache_size: int
    config: Any

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = True
                 ) -> list[int]:
        """Token ids of `text`. BOS only when the model adds one (or `add_bos=True`);
        special tokens such as `<|im_start|>` are parsed unless `special=False`."""
        with span("tokenize", chars=len(text)):
            return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **variables) -> str:
        """The prompt text the model's own chat template (or `chat_template`, Jinja text)
        makes of `messages`."""
        tok = self.tokenizer
        with span("chat_template", messages=len(messages)):
            return render_chat(
                chat_template or self.chat_template, list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                eos_token=tok.decode([tok.eos_id]) if tok.eos_id is not None else "",
                **variables,
            )

    def continued_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                         chat_template: str | None = None, **variables) -> str:
        """The prompt that continues the conversation's final message, an assistant's
        answer cut short (by `max_tokens`, or written by you to steer the answer): the
        conversation rendered without a generation prompt and cut right after that
        message's text, before the template closes the turn.

        Raises ValueError when the final message is not the assistant's, or when the
        template does not show its text as it is (so there is no place to cut)."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs the conversation to end with an "
                             "assistant message (the answer to continue)")
        content = messages[-1].get("content")
        if not isinstance(content, str) or not content.strip():
            raise ValueError("continue_final_message needs the final assistant message to "
                             "have text to continue")
        rendered = self.apply_chat_template(messages, add_generation_prompt=False,
                                            chat_template=chat_template, **variables)
        # templates may trim a message's surrounding whitespace: look for its inner text
        # (the last occurrence is the final message's)
        end = rendered.rfind(content.strip())
        if end < 0:
            raise ValueError("the chat template does not show the final assistant message's "
                             "text as it is, so the answer cannot be continued")
        return rendered[:end + len(content.strip())]

    def is_stop_token(self, token: int) -> bool:
        """True for the model's end-of-generation tokens (end of turn, EOS)."""
        return int(token) in self.tokenizer.eot_ids

    def _prompt_ids(self, prompt: str | Sequence[int], add_bos: bool | None,
                    include_prompt: bool) -> tuple[list[int], str]:
        """A prompt's checked token ids, and its text when `include_prompt` (else "")."""
        if isinstance(prompt, str):
            self._refuse_overlong(prompt, self.kv_cache_size, "prompt")
            ids = self.tokenize(prompt, add_bos=add_bos)
            text = prompt
        else:
            try:
                ids = [operator.index(i) for i in prompt]
            except TypeError:
                raise TypeError(f"a prompt is text or a sequence of token ids (integers), "
                                f"not {type(prompt).__name__}") from None
            text = self.detokenize(ids) if include_prompt else ""
        if not ids:
            raise ValueError("the prompt is empty (no tokens); pass text or token ids")
        if max(ids) >= self.config.n_vocab or min(ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {self.config.n_vocab})")
        if len(ids) >= self.kv_cache_size:
            raise ContextFullError(f"the prompt has {len(ids)} tokens and the context holds "
                             f"{self.kv_cache_size}; load with a larger kv_cache_size")
        return ids, text if include_prompt else ""

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: list | None, *,
                  add_generation_prompt: bool = True, chat_template: str | None = None,
                  continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation rendered with the chat template (BOS as the model
        wants); see `continued_prompt` for `continue_final_message`."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        variables = {"tools": tools} if tools else {}
        if continue_final_message:
            prompt = self.continued_prompt(messages, chat_template=chat_template, **variables)
        else:
            prompt = self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **variables)
        self._refuse_overlong(prompt, self.kv_cache_size, "conversation")
        ids = self.tokenize(prompt, add_bos=False)
        tok = self.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    @functools.cached_property
    def _longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for."""
        return max(map(len, self.tokenizer.tokens), default=1)

    def _refuse_overlong(self, text: str, limit: int, what: str) -> None:
        """Refuse `text` that cannot tokenize to fewer than `limit` tokens, before
        tokenizing it: no token covers more characters than the vocabulary's longest
        token, so a text longer than `limit` times that needs at least `limit` tokens
        (this bounds the tokenizer's work to a few hundred kB per prompt)."""
        if len(text) > limit * self._longest_token:
            raise ContextFullError(f"the {what} has {len(text)} characters, far more than the "
                             f"{self.kv_cache_size} tokens the context holds; shorten it or "
                             "load with a larger kv_cache_size")
