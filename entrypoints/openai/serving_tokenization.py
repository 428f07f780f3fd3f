"""POST /tokenize and /detokenize (vLLM's extra endpoints) and GET /v1/models."""
from __future__ import annotations

import asyncio

from halserve.entrypoints.openai.errors import BadRequestError
from halserve.entrypoints.openai.serving_chat import render_chat
from halserve.entrypoints.openai.serving_engine import OpenAIServing
from halserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


class OpenAIServingTokenization:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def models(self) -> ModelList:
        s = self.serving
        return ModelList(
            data=[
                ModelCard(id=name, created=s.created, root=s.model_path, max_model_len=s.max_model_len,
                          model_impl=getattr(s.engine.model_info, "model_impl", None))
                for name in s.served_model_names
            ] + [
                ModelCard(id=lora.lora_name, created=s.created, root=lora.lora_path, max_model_len=s.max_model_len,
                          parent=lora.base_model_name or s.served_model_names[0])
                for lora in s.lora_modules.values()
            ]
        )

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        s = self.serving
        s.check_model(req.model)
        tokenizer = s.tokenizer

        def work() -> list[int]:
            if req.messages is not None:
                messages = [m.template_dict() for m in req.messages]
                _, ids = render_chat(tokenizer, messages, s.chat_template, req.add_generation_prompt,
                                     req.continue_final_message, req.template_kwargs())
                return ids
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            return tokenizer.encode(req.prompt, add_special_tokens=add_special)

        try:
            ids = await asyncio.get_running_loop().run_in_executor(s.engine.tokenizer_pool, work)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None
        return TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        s = self.serving
        s.check_model(req.model)
        vocab = s.vocab_size
        for i, token in enumerate(req.tokens):
            if token < 0 or (vocab is not None and token >= vocab):
                raise BadRequestError(
                    f"token id {token} at position {i} is out of range: ids must be in [0, {vocab})",
                    param="tokens",
                )
        return DetokenizeResponse(prompt=s.tokenizer.decode(req.tokens))
