"""The parts of llama.cpp's /completion answer beyond the text: `timings`,
`generation_settings`, `tokens`, and the `response_fields` filter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strata.engine.api import validation as v
from strata.engine.api.errors import bad_request
from strata.engine.api.params import GenerationParams
from strata.engine.protocol import PromptProgress, SamplingSpec, Usage

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a new seed for every request
MAX_RESPONSE_FIELDS = 64


@dataclass(frozen=True)
class AnswerOptions:
    """What the request asks the answer to carry: `return_tokens` (the generated ids) and
    `response_fields` (only these, paths such as "generation_settings/n_predict")."""

    return_tokens: bool = False
    response_fields: tuple[str, ...] = ()
    # Streamed: a chunk per prompt chunk the engine evaluates (prompt_progress), and `timings`
    # in every chunk, not only the last.
    return_progress: bool = False
    timings_per_token: bool = False


def parse_answer_options(body: dict) -> AnswerOptions:
    """return_tokens and response_fields of a /completion or /infill body."""
    fields = body.get("response_fields")
    if fields is None:
        fields = []
    if (not isinstance(fields, list) or len(fields) > MAX_RESPONSE_FIELDS
            or not all(isinstance(f, str) and f for f in fields)):
        raise bad_request(f"'response_fields' must be a list of at most {MAX_RESPONSE_FIELDS} "
                          "field names (paths such as \"generation_settings/n_predict\")",
                          param="response_fields")
    return_progress = v.get_bool(body, "return_progress")
    if return_progress and not v.get_bool(body, "stream"):
        raise bad_request("'return_progress' reports a prompt's evaluation in a stream; set "
                          "'stream': true or leave it out", param="return_progress")
    return AnswerOptions(return_tokens=v.get_bool(body, "return_tokens"),
                         response_fields=tuple(fields), return_progress=return_progress,
                         timings_per_token=v.get_bool(body, "timings_per_token"))


def timings(usage: Usage) -> dict[str, Any]:
    """llama.cpp's `timings`: prompt tokens evaluated (the cached ones left out) and generated,
    with the engine's own clock for each phase."""
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_ms, predicted_ms = usage.prefill_s * 1000.0, usage.decode_s * 1000.0
    predicted_n = usage.completion_tokens
    # decode_s runs from the first token to the last: the first came with the prompt's
    # logits, so the rate is over the predicted_n - 1 decode steps (as llama.cpp's is).
    num_steps = max(predicted_n - 1, 0)

    def per_token_ms(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return n * 1000.0 / ms if ms > 0 else 0.0

    return {"cache_n": usage.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": per_token_ms(prompt_ms, prompt_n),
            "prompt_per_second": per_second(prompt_ms, prompt_n),
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": per_token_ms(predicted_ms, num_steps),
            "predicted_per_second": per_second(predicted_ms, num_steps)}


def progress_json(progress: PromptProgress) -> dict[str, Any]:
    """llama.cpp's `prompt_progress`: prompt tokens in all, reused, in the cache now, and the
    milliseconds of evaluation so far."""
    return {"total": progress.total, "cache": progress.cached,
            "processed": progress.processed, "time_ms": progress.prefill_s * 1000.0}


def running_timings(progress: PromptProgress | None, num_predicted: int,
                    decode_s: float) -> dict[str, Any]:
    """`timings` while a generation runs (timings_per_token): the prompt's from the engine's
    last report, decoding on the host's clock since the first token arrived."""
    if progress is None:
        progress = PromptProgress("", 0, 0, 0)
    return timings(Usage(prompt_tokens=progress.processed, completion_tokens=num_predicted,
                         cached_tokens=progress.cached, finish_reason="",
                         prefill_s=progress.prefill_s, decode_s=decode_s))


def generation_settings(spec: SamplingSpec | None, params: GenerationParams,
                        id_slot: int) -> dict[str, Any]:
    """The settings the generation ran with, the server's defaults filled in."""
    settings: dict[str, Any] = {
        "n_predict": -1 if params.max_tokens is None else params.max_tokens,
        "stop": list(params.stops), "stream": params.is_stream,
        "n_probs": params.num_logprobs or 0, "post_sampling_probs": params.post_sampling_probs,
        "cache_prompt": params.reuse_cache,
        "id_slot": id_slot}
    if spec is not None:
        settings |= {
            "seed": RANDOM_SEED if spec.seed is None else spec.seed,
            "temperature": spec.temperature, "top_k": spec.top_k, "top_p": spec.top_p,
            "min_p": spec.min_p, "repeat_penalty": spec.repeat_penalty,
            "repeat_last_n": spec.penalty_last_n, "presence_penalty": spec.presence_penalty,
            "frequency_penalty": spec.frequency_penalty,
            # llama.cpp's form; a banned token's -inf is null in JSON, as llama.cpp writes it.
            "logit_bias": [{"token": token, "bias": None if math.isinf(bias) else bias}
                           for token, bias in spec.logit_bias]}
    return settings


def only_fields(answer: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """The answer cut to `response_fields`: each path's value under the path itself; a path
    the answer lacks is left out (as llama.cpp does)."""
    if not fields:
        return answer
    kept = {}
    for path in fields:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            kept[path] = value
    return kept
