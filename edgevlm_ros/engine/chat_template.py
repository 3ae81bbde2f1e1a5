"""Render a GGUF's chat template (`tokenizer.chat_template`) into a prompt string.

The template is Jinja source taken from a model file, i.e. untrusted input. It is
rendered in Jinja's immutable sandbox (no imports, no access to Python internals,
no mutation of our objects) with the helpers Hugging Face templates expect
(`raise_exception`, `strftime_now`, transformers' `tojson`, loop controls, the
`{% generation %}` tag).

The sandbox stops escapes but not resource exhaustion, so on top of it the cost of a
render is bounded (best effort, each check cheap):
- the template source size;
- the rendered prompt, streamed and cut off at MAX_OUTPUT_CHARS;
- all text emitted anywhere (`{% set %}` blocks and macros included);
- loop iterations plus calls (a step budget);
- the "weight" (characters + items, counting shared references each time) of any
  value before it is turned into text, joined, repeated or concatenated, and the
  size of every value built, so no operation can allocate far past the limit.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

__all__ = ["MAX_OUTPUT_CHARS", "ChatTemplateError", "render_chat"]

# A prompt for a small on-robot model is a few KB; 1 MB of text means something is wrong.
MAX_OUTPUT_CHARS = 1_000_000
# Text emitted anywhere during one render; intermediate blocks and macros count too,
# hence the headroom over the final limit.
MAX_EMITTED_CHARS = 4 * MAX_OUTPUT_CHARS
# Real chat templates are at most a few tens of KB.
MAX_TEMPLATE_CHARS = 256 * 1024
# Loop iterations plus calls per render; real templates need a few dozen per message.
MAX_STEPS = 1_000_000
# Widths in printf/format specs and filter arguments that multiply per line.
_MAX_FORMAT_WIDTH = 9999
_MAX_FORMAT_STRING = 4096
_MAX_LINE_WIDTH = 1000
_MAX_POW_BITS = 4096


class ChatTemplateError(ValueError):
    """The chat template is invalid, hostile, or produced an unacceptable prompt."""


class _LimitExceeded(ChatTemplateError):
    pass


# --- per-render budget ---------------------------------------------------------------


class _Budget:
    """Counters of one render: steps taken and characters emitted."""

    def __init__(self) -> None:
        self.steps = 0
        self.emitted = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _LimitExceeded(f"chat template exceeded {MAX_STEPS} loop iterations and calls")

    def emit(self, n_chars: int) -> None:
        self.emitted += n_chars
        if self.emitted > MAX_EMITTED_CHARS:
            raise _LimitExceeded(f"chat template emitted more than {MAX_EMITTED_CHARS} characters")


# The budget of the render in progress. A context variable keeps concurrent renders
# (one per thread) apart while compiled templates are shared between them.
_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("edgevlm_chat_budget")


# --- value checks --------------------------------------------------------------------


def _children(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, list | tuple | set | frozenset):
        return value
    if isinstance(value, Namespace):
        # A namespace prints its attributes; the sandbox keeps templates from this name.
        attrs: dict[str, Any] = object.__getattribute__(value, "_Namespace__attrs")
        return [*attrs.keys(), *attrs.values()]
    return ()


def _weight(value: Any, limit: int = MAX_OUTPUT_CHARS) -> int:
    """Characters plus items in `value`, counting shared references every time.

    That is roughly what str() of the value would produce; containers can hold the
    same large string many times, so their own length says nothing. Stops counting
    once past `limit`, so the cost is at most `limit` visits.
    """
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        total += len(item) if isinstance(item, str) else 1
        stack.extend(_children(item))
    return total


def _check_weight(*values: Any) -> None:
    if sum(_weight(v) for v in values) > MAX_OUTPUT_CHARS:
        raise _LimitExceeded(f"chat template value larger than {MAX_OUTPUT_CHARS} characters")


def _check_size(value: Any) -> Any:
    """Refuse a built value that is larger than any prompt may be; pass it through."""
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_OUTPUT_CHARS:
        raise _LimitExceeded(f"chat template built a value of {len(value)} items (limit {MAX_OUTPUT_CHARS})")
    return value


def _check_format_string(fmt: str) -> None:
    """Refuse printf/format specs that can allocate far more than their own size."""
    if len(fmt) > _MAX_FORMAT_STRING:
        raise _LimitExceeded(f"format string longer than {_MAX_FORMAT_STRING} characters")
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        raise _LimitExceeded("format strings with computed widths are not allowed")
    if any(int(n) > _MAX_FORMAT_WIDTH for n in re.findall(r"\d+", fmt)):
        raise _LimitExceeded(f"format width above {_MAX_FORMAT_WIDTH}")


def _check_replace(text: str, old: Any, new: Any) -> None:
    if isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        if len(text) + hits * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
            raise _LimitExceeded("replace result too large")


def _check_join(separator: str, items: Any) -> None:
    if isinstance(items, list | tuple):
        _check_weight(items)
        if len(separator) * len(items) > MAX_OUTPUT_CHARS:
            raise _LimitExceeded("join result too large")


def _check_ints(args: Iterable[Any], limit: int, what: str) -> None:
    # bool is an int; True as a flag argument is not a size.
    if any(isinstance(a, int) and not isinstance(a, bool) and a > limit for a in args):
        raise _LimitExceeded(f"{what}: size argument above {limit}")


def _check_multiply(left: Any, right: Any) -> None:
    seq, count = (left, right) if isinstance(left, str | list | tuple) else (right, left)
    if isinstance(seq, str | list | tuple) and isinstance(count, int) and _weight(seq) * count > MAX_OUTPUT_CHARS:
        raise _LimitExceeded("repetition too large")
    # Repeated squaring grows an int's size exponentially too.
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > _MAX_POW_BITS:
        raise _LimitExceeded("product too large")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        _check_multiply(left, right)
    elif operator == "+":
        if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
            _check_weight(left, right)
    elif operator == "**":
        ints = isinstance(left, int) and isinstance(right, int)
        if ints and abs(left) > 1 and right * abs(left).bit_length() > _MAX_POW_BITS:
            raise _LimitExceeded("power too large")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left)
        _check_weight(right)


# str methods whose integer argument sets the size of the result.
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})


def _check_str_method(text: str, name: str, args: tuple[Any, ...]) -> None:
    if name in _WIDTH_METHODS:
        _check_ints(args, MAX_OUTPUT_CHARS, f"str.{name}")
    elif name == "expandtabs" and args and isinstance(args[0], int):
        if (text.count("\t") + 1) * args[0] > MAX_OUTPUT_CHARS:
            raise _LimitExceeded("str.expandtabs result too large")
    elif name == "replace" and len(args) >= 2:
        _check_replace(text, args[0], args[1])
    elif name == "join" and args:
        _check_join(text, args[0])
    elif name in ("format", "format_map"):
        _check_format_string(text)


# --- the environment -----------------------------------------------------------------


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox plus size and step limits on operators and calls."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        # Jinja answers a forbidden attribute with an Undefined that prints as "";
        # a template that reaches for internals is hostile, so fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _BUDGET.get().step()
        _check_weight(*args, *kwargs.values())
        # The sandbox hands out str.format wrapped; look through the wrapper.
        target = getattr(obj, "__wrapped__", obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(target, "__name__", ""), args)
        return _check_size(super().call(context, obj, *args, **kwargs))


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with
    it for training masks; for rendering a prompt it is a plain block."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a built-in filter: arguments are checked before it runs (some can allocate
    a lot in one call) and its result after."""

    # Filters marked pass_context/pass_environment/pass_eval_context get that first.
    first = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)  # also copies Jinja's pass_* marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_weight(*args, *kwargs.values())
        if len(args) > first:
            _check_filter_call(name, args[first], (*args[first + 1 :], *kwargs.values()))
        return _check_size(fn(*args, **kwargs))

    return wrapper


def _check_filter_call(name: str, value: Any, params: tuple[Any, ...]) -> None:
    """Pre-checks for the built-in filters that can allocate a lot in one call."""
    if name == "format" and isinstance(value, str):
        _check_format_string(value)
    elif name == "replace" and isinstance(value, str) and len(params) >= 2:
        _check_replace(value, params[0], params[1])
    elif name == "join":
        _check_join(params[0] if params and isinstance(params[0], str) else "", value)
    elif name in ("center", "indent", "wordwrap"):
        _check_ints(params, _MAX_LINE_WIDTH, name)
    elif name in ("batch", "slice"):
        _check_ints(params, MAX_OUTPUT_CHARS, name)


def _raise_exception(message: str) -> NoReturn:
    # HF templates call this to reject conversations they cannot format.
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson (not Jinja's HTML-escaping one), so prompts match theirs.
    _check_weight(value)
    if indent is not None and not 0 <= indent <= 16:
        raise _LimitExceeded("tojson indent must be between 0 and 16")
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _check_size(text)


# Names of the guard functions that the rewritten template calls (see _Guard).
_ITER = "__edgevlm_iter"
_EMIT = "__edgevlm_emit"
_WEIGH = "__edgevlm_weigh"
_SIZED = "__edgevlm_sized"


def _guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _BUDGET.get()
    for item in iterable:
        budget.step()
        yield item


def _guarded_emit(value: Any) -> Any:
    _check_weight(value)
    _BUDGET.get().emit(len(str(value)))
    return value


def _guarded_weigh(value: Any) -> Any:
    _check_weight(value)
    return value


class _Guard(NodeTransformer):
    """Rewrites a parsed template so loops, output and `~` go through the guards.

    Jinja has no hook for loop iterations, emitted text or `~` concatenation, so the
    parsed template is rewritten to call guard functions at those points.
    """

    @staticmethod
    def _wrap(name: str, node: nodes.Expr) -> nodes.Call:
        return nodes.Call(nodes.Name(name, "load"), [node], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:  # Jinja visitor naming
        self.generic_visit(node)
        node.iter = self._wrap(_ITER, node.iter)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [self._wrap(_EMIT, child) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        node.nodes = [self._wrap(_WEIGH, child) for child in node.nodes]
        return self._wrap(_SIZED, node)


def _make_environment() -> _BoundedSandbox:
    # trim_blocks/lstrip_blocks and loop controls as transformers renders templates.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals.pop("lipsum", None)  # generates as much text as asked for
    env.globals.update(
        {
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            _ITER: _guarded_iter,
            _EMIT: _guarded_emit,
            _WEIGH: _guarded_weigh,
            _SIZED: _check_size,
        }
    )
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Parse, guard and compile, once per distinct template string."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template is {len(template)} characters (limit {MAX_TEMPLATE_CHARS})")
    tree = _Guard().visit(_ENV.parse(template))
    tree.set_environment(_ENV)
    return _ENV.from_string(tree)


# --- rendering -----------------------------------------------------------------------


def _render_guarded(template: str, context: dict[str, Any]) -> str:
    compiled = _compile(template)
    token = _BUDGET.set(_Budget())
    try:
        # Streamed, so a runaway template is stopped at the limit rather than after.
        out: list[str] = []
        size = 0
        for chunk in compiled.generate(**context):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise _LimitExceeded(f"rendered prompt exceeds {MAX_OUTPUT_CHARS} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        _BUDGET.reset(token)


def _flat_content(content: str | list[dict[str, str]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if p["type"] == "text" else "<image>" for p in content)


def _chatml(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    turns = [f"<|im_start|>{m['role']}\n{_flat_content(m['content'])}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        turns.append("<|im_start|>assistant\n")
    return "".join(turns)


def _check_content(i: int, content: object) -> str | list[dict[str, str]]:
    """A message's content: a string, or a list of typed parts as multimodal templates
    (SmolVLM's) expect: {"type": "text", "text": ...} or {"type": "image"}."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                raise ChatTemplateError(f"message {i}: content parts must be {{'type': 'text' | 'image', ...}}")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in part.items()):
                raise ChatTemplateError(f"message {i}: content parts hold strings only")
            parts.append(dict(part))
        return parts
    raise ChatTemplateError(f"message {i} needs a string 'content' or a list of content parts")


def _check_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role'")
        # Plain copies: the template sees data only, never the caller's objects.
        checked.append({"role": message["role"], "content": _check_content(i, message.get("content"))})
    return checked


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render `messages` ({"role", "content"} dicts) with a GGUF chat template.

    `template` is `tokenizer.chat_template` from the GGUF. When the GGUF has none
    (None or ""), the conversation is rendered as ChatML instead:
    `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
    `<|im_start|>assistant\\n` if `add_generation_prompt`.

    Compiled templates are cached per template string. Raises ChatTemplateError (a
    ValueError) when the template does not compile, calls `raise_exception`, reaches
    for anything the sandbox forbids, exceeds a resource limit, or renders a prompt
    longer than MAX_OUTPUT_CHARS characters.
    """
    checked = _check_messages(messages)
    if not template:
        rendered = _chatml(checked, add_generation_prompt)
    else:
        context = {
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
        try:
            rendered = _render_guarded(template, context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # anything a hostile template provokes is its failure
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if len(rendered) > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"rendered prompt exceeds {MAX_OUTPUT_CHARS} characters")
    return rendered
