"""Text generation: KV-cached sampling, streaming, batches and beam search.

>>> result = generate(model, "Once upon a time", max_new_tokens=20, temperature=0)
>>> result.text, result.token_ids, result.finish_reason
>>> for piece in stream(model, "Hello", chat=True): print(piece, end="", flush=True)

Where things are: ``api.py`` the entry points and the rules they follow (``result.py`` what they
return); ``request.py`` option
and prompt checks; ``decode.py`` the KV-cached decode loop; ``sampling.py`` the samplers
(temperature, top-k, top-p, min-p, repetition penalty); ``batch_run.py`` (rows decoded as one
batch, each with its own budget and stop strings: ``generate_batch``, ``lucidlm serve
--parallel``; ``row_joins.py``: prompts that join a batch under way, continuous batching);
``beam_search.py``; ``sliding.py``
(generation past the context window); ``streaming.py`` (text pieces, stop strings);
``defaults.py`` (sampling settings that come from the model); ``speculative.py`` (drafted
tokens checked in one pass: ``generate(..., draft="prompt" | model)``); ``chat_template.py`` and
``template_sandbox.py`` (chat prompts); ``prompt_logprobs.py`` (each prompt token's log-prob, for
scoring given text rather than generating it).
"""

from lucidlm.generation.api import GenerationResult, TextStream, generate, generate_batch, stream
from lucidlm.generation.beam_search import beam_search
from lucidlm.generation.decode import DecodeSession
from lucidlm.generation.prompt_logprobs import PromptLogprobs, prompt_logprobs
from lucidlm.generation.request import check_options
from lucidlm.generation.sampling import SamplingSettings, process_logits, sample_next
from lucidlm.generation.streaming import TextAssembler

__all__ = ["GenerationResult", "TextStream", "generate", "stream", "generate_batch", "check_options", "beam_search",
           "SamplingSettings", "DecodeSession", "process_logits", "sample_next", "TextAssembler",
           "PromptLogprobs", "prompt_logprobs"]
