"""What a request may ask for, checked before any work: body size, prompt tokens against the context, tokens to
generate, choices, images (count, pixels, upload size), the queue. `serve`'s flags set them."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 << 20  # a request body (JSON, or a multipart upload with its images)
    max_tokens: int = 4096  # tokens one reply may ask for (also capped by the context)
    max_n: int = 8  # choices / images per request
    max_queue: int = 64  # requests waiting; past it: 429 with Retry-After
    max_image_pixels: int = 2048 * 2048  # width x height of an output image
    max_images: int = 6  # reference images of an edit
    max_inputs: int = 256  # texts of one embeddings request
    retry_after_s: int = 1

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(400, f"`n` is {n}; this server answers at most {self.max_n} per request (serve "
                                f"--max-n)", "n")

    def check_max_tokens(self, value: int, field: str, prompt_tokens: int, context: int) -> int:
        """The tokens the reply may take: ``value`` checked against the server's cap and the room the context
        leaves after the prompt (a prompt that leaves none is refused)."""
        if prompt_tokens >= context:
            raise APIError(400, f"the prompt is {prompt_tokens} tokens long; the model's context is {context} "
                                f"tokens for prompt and reply together, which leaves no room for a reply. Shorten "
                                f"the prompt.", "messages" if field != "prompt" else "prompt",
                           "context_length_exceeded")
        if value > self.max_tokens:
            raise APIError(400, f"`{field}` is {value}; this server generates at most {self.max_tokens} tokens per "
                                f"reply (serve --max-tokens)", field)
        room = context - prompt_tokens
        if value > room:
            raise APIError(400, f"`{field}` is {value}, but the prompt ({prompt_tokens} tokens) leaves room for "
                                f"{room} in the model's context of {context}; ask for at most {room}", field,
                           "context_length_exceeded")
        return value

    def check_size(self, width: int, height: int) -> None:
        if width * height > self.max_image_pixels:
            raise APIError(400, f"`size` {width}x{height} is {width * height:,} pixels; this server makes images "
                                f"of at most {self.max_image_pixels:,} pixels (serve --max-image-pixels)", "size")

    def queue_full(self) -> APIError:
        return APIError(429, f"the server is busy: {self.max_queue} requests already wait (serve --max-queue); "
                             f"retry after {self.retry_after_s} s", code="queue_full",
                        headers={"Retry-After": str(self.retry_after_s)})
