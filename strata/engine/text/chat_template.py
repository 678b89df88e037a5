"""Chat templates from model files, rendered in a jinja2 sandbox with a time and size budget.

A template comes from a downloaded model, so it is untrusted code: it runs in jinja2's
`ImmutableSandboxedEnvironment` (no attribute tricks, no mutation of our objects), and every
loop iteration and call is counted against a deadline so a template that loops forever raises
ChatTemplateError instead of hanging the server. The environment matches Hugging Face's
`apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception,
strftime_now) so templates render the same text.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.engine.text.errors import ChatTemplateError

# ChatML, the fallback for models without a template (SmolLM2 and Qwen use it too).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_MAX_RENDER_S = 2.0
DEFAULT_MAX_OUTPUT_CHARS = 8 * 1024 * 1024
_CHECK_EVERY_STEPS = 256
_STEP_ITER = "__strata_step_iter"


class _TemplateRaised(Exception):
    """raise_exception() from inside a template: the template rejected its input."""


class _RenderBudget:
    """Per-render step counter; checking the clock every N steps keeps it cheap."""

    def __init__(self, max_render_s: float, max_output_chars: int):
        self.deadline_s = time.monotonic() + max_render_s
        self.max_render_s = max_render_s
        self.max_output_chars = max_output_chars
        self.num_steps = 0

    def step(self) -> None:
        self.num_steps += 1
        if self.num_steps % _CHECK_EVERY_STEPS == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline_s:
            raise ChatTemplateError(
                f"chat template did not finish within {self.max_render_s:g} s "
                f"({self.num_steps} loop steps): it loops; fix the model's template"
            )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox plus budget hooks: every for-loop iteration and every call takes a step."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, max_output_chars: int):
        super().__init__(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        )
        self._local = threading.local()
        self._max_output_chars = max_output_chars
        self.globals[_STEP_ITER] = self._step_iter
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson

    @property
    def budget(self) -> _RenderBudget | None:
        return getattr(self._local, "budget", None)

    @budget.setter
    def budget(self, value: _RenderBudget | None) -> None:
        self._local.budget = value

    def _parse(self, source, name, filename):
        # Wrap every loop's iterable so iterations are counted (jinja has no while, so loops
        # and recursive calls are the only ways a template can run long).
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            step_iter = nodes.Name(_STEP_ITER, "load", lineno=loop.lineno)
            loop.iter = nodes.Call(step_iter, [loop.iter], [], None, None, lineno=loop.lineno)
        return tree

    def _step_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = self.budget
        for item in iterable:
            if budget is not None:
                budget.step()
            yield item

    def call(self, context, obj, /, *args, **kwargs):
        budget = self.budget
        if budget is not None:
            budget.step()
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        # 'x' * 10**9 or 9 ** 10**9 would allocate or compute for minutes without any loop.
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                is_repeat = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if is_repeat and len(seq) * count > self._max_output_chars:
                    raise ChatTemplateError("chat template built an oversized string; fix it")
        is_int_power = operator == "**" and isinstance(left, int) and isinstance(right, int)
        if is_int_power and abs(left) > 1 and right > 4096:
            raise ChatTemplateError("chat template computed an oversized power; fix it")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF keeps non-ASCII as is; the default json.dumps would turn it into \u escapes.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """A compiled, sandboxed chat template; `render` is safe to call from several threads."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 max_render_s: float = DEFAULT_MAX_RENDER_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_render_s = max_render_s
        self.max_output_chars = max_output_chars
        self._env = _BoundedSandbox(max_output_chars)
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template does not compile (line {exc.lineno}: "
                f"{_one_line(exc.message)}); fix the model's template"
            ) from exc

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """Render the conversation; extra keywords (enable_thinking, ...) reach the template."""
        budget = _RenderBudget(self.max_render_s, self.max_output_chars)
        variables = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        self._env.budget = budget
        try:
            return self._collect(self._template.generate(**variables), budget)
        except ChatTemplateError:
            raise
        except _TemplateRaised as exc:
            raise ChatTemplateError(
                f"the chat template rejected these messages: {_one_line(exc)}"
            ) from None
        except RecursionError:
            raise ChatTemplateError(
                "chat template recursed too deeply; fix the model's template"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a template can raise anything (TypeError, ...)
            raise ChatTemplateError(
                f"chat template failed: {type(exc).__name__}: {_one_line(exc)}; "
                "check the messages' roles and contents"
            ) from None
        finally:
            self._env.budget = None

    def _collect(self, chunks: Iterator[str], budget: _RenderBudget) -> str:
        parts: list[str] = []
        num_chars = 0
        for chunk in chunks:
            parts.append(chunk)
            num_chars += len(chunk)
            if num_chars > budget.max_output_chars:
                raise ChatTemplateError(
                    f"chat template produced more than {budget.max_output_chars} characters; "
                    "fix the model's template"
                )
            budget.check_time()
        return "".join(parts)
