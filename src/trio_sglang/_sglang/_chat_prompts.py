"""Chat prompts as SGLang's own server renders them, for ``SGLangEngine.render_chat``.

SGLang 0.5.23 renders chat messages in its OpenAI route, not in the engine:
``OpenAIServingChat._convert_to_internal_request`` runs ``_process_messages``
(``_apply_jinja_template``: the model's Jinja template, or a ``--chat-template``
file, through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
and then ``tokenizer.encode``; ``_apply_conversation_template`` for a named
``--chat-template``; the Python encoders some models have), where
``continue_final_message`` takes a last assistant message off and appends
its tokens, and a last assistant message is made the user's otherwise. It
hands the TokenizerManager the ``GenerateReqInput`` it built: token ids for a
text model, text for a multimodal one.

Rather than copy those steps (and drift from them with every model SGLang
adds a case for), this runs that very code over the engine's
TokenizerManager and takes the prompt from the request it builds. Its
template manager is the ``sglang.Engine``'s, or one set up as SGLang's
``init_tokenizer_manager`` sets it up, from the server arguments
(``chat_template``, ``model_path``) the TokenizerManager was made with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SGLangChat"]


class SGLangChat:
    """SGLang's chat route over one TokenizerManager, as far as the prompt."""

    def __init__(self, tokenizer_manager: Any, template_manager: Any = None) -> None:
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

        if template_manager is None:
            try:
                from sglang.srt.parser.template_manager import TemplateManager
            except ImportError:  # its home before 0.5.17
                from sglang.srt.managers.template_manager import TemplateManager

            args = tokenizer_manager.server_args
            template_manager = TemplateManager()
            # As SGLang's server does: a template file replaces the tokenizer's own.
            template_manager.load_chat_template(
                tokenizer_manager, args.chat_template, args.model_path
            )
        self._serving = OpenAIServingChat(tokenizer_manager, template_manager)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool
    ) -> str | list[int]:
        """What SGLang's chat route would give the TokenizerManager for ``messages``.

        A template's refusal is a ``ValueError``, as SGLang makes it (and so
        is pydantic's, for a message SGLang's schema refuses).
        """
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            messages=list(messages), continue_final_message=continue_final_message
        )
        adapted, _ = self._serving._convert_to_internal_request(request)
        if adapted.input_ids is not None:
            return list(adapted.input_ids)
        text: str = adapted.text
        return text
