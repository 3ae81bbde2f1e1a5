"""The node's parameters as plain Python: names, defaults, descriptions, and validation.

`node.py` declares exactly these (the defaults here are the ones in `config/edgevlm.yaml`),
validates them at start with `validate()`, and checks run-time changes with `apply_changes()`.
Both raise `ParamError`, whose message names the parameter, the value and the rule, so a bad
start is one line and a refused `ros2 param set` says why.

Conventions, because ROS parameters have no "unset": an empty string means "the default"
(model, mmproj, system_prompt, prefix_cache_dir, description_schema) and 0 means "none" /
"automatic" (threads, period_s, deadline_ms, partial_every); an empty `cameras` list means one
camera on the node's own topics (`image`, `description`, ...), as before cameras had names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..engine.kv_types import KV_TYPES

__all__ = ["PARAMS", "NodeParams", "ParamError", "ParamSpec", "apply_changes", "as_values", "defaults", "validate"]


class ParamError(ValueError):
    """A parameter value the node cannot use; the message is meant for the user as it is."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    default: str | int | float | tuple[str, ...]
    description: str
    runtime: bool = False  # may change while the node runs (else read-only after start)

    @property
    def kind(self) -> type:
        return type(self.default)


IMAGE_MODES = ("single", "tiled")
TRANSPORTS = ("raw", "compressed")
RELIABILITIES = ("best_effort", "reliable")
MAX_CAMERAS = 16
# A camera name is one ROS name token: it becomes the first part of the camera's topics.
CAMERA_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")

PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model", "", "text model GGUF file (a path, or a name looked up in the model directories); "
              "empty, and mmproj empty too: the embedded demo model; empty beside an mmproj: SmolLM2-135M-Instruct"),
    ParamSpec("mmproj", "", "vision tower GGUF file (llama.cpp's mmproj layout); empty: the embedded demo mmproj"),
    ParamSpec("system_prompt", "", "fixed system prompt; its KV cache is computed once and reused for every frame; "
              "empty: the model's default"),
    ParamSpec("prompt", "Describe the image in one sentence.", "the user's request, sent with every frame",
              runtime=True),
    ParamSpec("max_new_tokens", 32, "most tokens generated per frame (>= 1)", runtime=True),
    ParamSpec("threads", 0, "engine threads; 0: the cores this process may use, at most 8"),
    ParamSpec("image_mode", "single", "single: one encoder tile per frame, constant latency; "
              "tiled: SmolVLM's tiles plus a global view (slower, more detail)"),
    ParamSpec("transport", "raw", "raw: subscribe sensor_msgs/Image on 'image'; "
              "compressed: sensor_msgs/CompressedImage (JPEG/PNG) on 'image/compressed'"),
    ParamSpec("qos_depth", 1, "image subscription queue depth (keep last)"),
    ParamSpec("qos_reliability", "best_effort", "image subscription reliability: best_effort (matches every "
              "camera) or reliable (matches only reliable publishers)"),
    ParamSpec("period_s", 0.0, "describe at most once per this many seconds; 0: as often as the engine can",
              runtime=True),
    ParamSpec("deadline_ms", 0.0, "time budget of one frame from the start of its description; decoding stops "
              "when it runs out, the text so far is published and the miss is counted; 0: none", runtime=True),
    ParamSpec("prefix_cache_dir", "", "directory for the system prompt's KV cache file, reused across starts when "
              "model, prompt and engine version match; empty: compute it at every start, keep no file"),
    ParamSpec("max_image_pixels", 1 << 24, "frames with more pixels than this (from the message header) are "
              "refused before any memory is allocated"),
    ParamSpec("cameras", (), "camera names; camera C reads C/image (or C/image/compressed) and publishes "
              "C/description, C/latency/*; the worker serves cameras with fresh frames round robin. "
              "Empty: one camera on image, description, latency/*"),
    ParamSpec("question_queue", 8, "most questions (Ask service, Describe action) waiting at once; "
              "one more is refused at once"),
    ParamSpec("question_frame_timeout_s", 2.0, "how long a question waits for its camera's first frame when "
              "the request does not say", runtime=True),
    ParamSpec("partial_every", 4, "publish the text so far on C/description/partial every this many tokens "
              "while a frame is described; 0: never (the describe action streams whatever this says)",
              runtime=True),
    ParamSpec("description_schema", "", "JSON schema the periodic description must follow (published on "
              "C/description/json as well as C/description); empty: free text", runtime=True),
    ParamSpec("speculation", True, "draft each description from the camera's last 3 and n-grams of the prompt "
              "and the answer (speculative decoding: the same text, sooner when the view changes slowly; not "
              "with a schema; a recurrent decoder such as Qwen3.5 rolls its state back after a rejected draft)",
              runtime=True),
    ParamSpec("mtp", False, "also draft from the model file's multi-token-prediction block where it has one "
              "(Qwen3.5's nextn tensors): the same text; each draft costs a step of that block and the output "
              "head, so it pays only where its drafts are mostly right"),
    ParamSpec("kv_type", "f32", "how the KV cache stores keys and values: f32, f16 (half the memory) or q8_0 "
              "(int8 blocks of 32 with a scale per block and head: 0.27x the memory, faster attention over "
              "long contexts; logits move by int8's rounding of keys and values)"),
    ParamSpec("vision_int8", False, "run the vision tower's matrices on int8 products where this CPU has an int8 "
              "kernel (AVX-VNNI, AVX512-VNNI, Arm dotprod): weights requantized to int8 blocks at load, "
              "activations to int8 blocks; about half the encode time on a robot-class CPU, the image features "
              "move by int8's rounding"),
)
_SPECS = {p.name: p for p in PARAMS}


@dataclass(frozen=True)
class NodeParams:
    """Validated parameter values (empty strings and zeros already turned into None)."""

    model: str | None
    mmproj: str | None
    system_prompt: str | None
    prompt: str
    max_new_tokens: int
    threads: int | None
    image_mode: str
    transport: str
    qos_depth: int
    qos_reliability: str
    period_s: float
    deadline_ms: float | None
    prefix_cache_dir: str | None
    max_image_pixels: int
    cameras: tuple[str, ...] = ()
    question_queue: int = 8
    question_frame_timeout_s: float = 2.0
    partial_every: int = 4
    description_schema: str | None = None
    speculation: bool = True
    kv_type: str = "f32"
    mtp: bool = False
    vision_int8: bool = False

    @property
    def image_topic(self) -> str:
        """The relative topic a camera's subscription reads, after its prefix (image_transport's naming)."""
        return "image/compressed" if self.transport == "compressed" else "image"

    @property
    def camera_names(self) -> tuple[str, ...]:
        """The cameras served; "" is the unnamed camera on the node's own topics."""
        return self.cameras or ("",)


def camera_topic(camera: str, name: str) -> str:
    """Camera `camera`'s relative topic `name` ("front/description"; "description" for "")."""
    return f"{camera}/{name}" if camera else name


def defaults() -> dict[str, str | int | float | list[str]]:
    """Every parameter's default as ROS and YAML hold it (a string array as a list)."""
    return {p.name: list(p.default) if isinstance(p.default, tuple) else p.default for p in PARAMS}


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _typed(name: str, value: Any) -> str | int | float | tuple[str, ...]:
    """value checked against the parameter's type; an integer is accepted for a double, and for a
    string array any list or tuple of strings (None: an empty YAML list, whose type ROS cannot tell)."""
    kind = _SPECS[name].kind
    if kind is tuple:
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ParamError(f"parameter '{name}' must be a list of strings, got {_describe(value)}")
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        wanted = {str: "a string", int: "an integer", float: "a number"}[kind]  # type: ignore[index]
        raise ParamError(f"parameter '{name}' must be {wanted}, got {_describe(value)}")
    return value


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ParamError(f"parameter '{name}' must be one of {', '.join(choices)}; got '{value}'")
    return value


def _at_least(name: str, value: int | float, low: int | float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ParamError(f"parameter '{name}' must be a finite number, got {value}")
    if value < low:
        raise ParamError(f"parameter '{name}' must be >= {low}, got {value}")


def validate(values: Mapping[str, Any]) -> NodeParams:
    """NodeParams from raw values (missing names take their defaults). Raises ParamError."""
    unknown = sorted(set(values) - set(_SPECS))
    if unknown:
        raise ParamError(f"unknown parameter '{unknown[0]}' (known: {', '.join(_SPECS)})")
    raw = {**defaults(), **values}
    v = {name: _typed(name, raw[name]) for name in _SPECS}

    prompt = str(v["prompt"])
    if not prompt.strip():
        raise ParamError("parameter 'prompt' must not be empty")
    for name, low in (("max_new_tokens", 1), ("threads", 0), ("qos_depth", 1), ("max_image_pixels", 1),
                      ("period_s", 0.0), ("deadline_ms", 0.0), ("question_queue", 1),
                      ("question_frame_timeout_s", 0.0), ("partial_every", 0)):
        _at_least(name, v[name], low)  # type: ignore[arg-type]
    if int(v["threads"]) > 256:
        raise ParamError(f"parameter 'threads' must be <= 256, got {v['threads']}")

    if int(v["question_queue"]) > 1024:
        raise ParamError(f"parameter 'question_queue' must be <= 1024, got {v['question_queue']}")
    cameras = _cameras(v["cameras"])  # type: ignore[arg-type]

    def optional(name: str) -> str | None:
        text = str(v[name])
        return text if text.strip() else None

    schema = optional("description_schema")
    if schema is not None:
        from ..engine.constraints import check_schema  # the engine's own rules, one place
        try:
            check_schema(schema)
        except ValueError as exc:
            raise ParamError(f"parameter 'description_schema': {exc}") from None

    return NodeParams(
        model=optional("model"),
        mmproj=optional("mmproj"),
        system_prompt=optional("system_prompt"),
        prompt=prompt,
        max_new_tokens=int(v["max_new_tokens"]),
        threads=int(v["threads"]) or None,
        image_mode=_choice("image_mode", str(v["image_mode"]), IMAGE_MODES),
        transport=_choice("transport", str(v["transport"]), TRANSPORTS),
        qos_depth=int(v["qos_depth"]),
        qos_reliability=_choice("qos_reliability", str(v["qos_reliability"]), RELIABILITIES),
        period_s=float(v["period_s"]),
        deadline_ms=float(v["deadline_ms"]) or None,
        prefix_cache_dir=optional("prefix_cache_dir"),
        max_image_pixels=int(v["max_image_pixels"]),
        cameras=cameras,
        question_queue=int(v["question_queue"]),
        question_frame_timeout_s=float(v["question_frame_timeout_s"]),
        partial_every=int(v["partial_every"]),
        description_schema=schema,
        speculation=bool(v["speculation"]),
        kv_type=_choice("kv_type", str(v["kv_type"]), KV_TYPES),
        mtp=bool(v["mtp"]),
        vision_int8=bool(v["vision_int8"]),
    )


def _cameras(names: tuple[str, ...]) -> tuple[str, ...]:
    if len(names) > MAX_CAMERAS:
        raise ParamError(f"parameter 'cameras' lists {len(names)} cameras; at most {MAX_CAMERAS}")
    for name in names:
        if not CAMERA_NAME.fullmatch(name):
            raise ParamError(f"parameter 'cameras': '{name}' is not a camera name (a letter, then letters, digits "
                             "or _; it becomes the first part of the camera's topics)")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ParamError(f"parameter 'cameras' names '{dup}' twice")
    return names


def as_values(params: NodeParams) -> dict[str, str | int | float | tuple[str, ...]]:
    """The raw parameter values that validate() turns into params (None back to '' or 0)."""
    out: dict[str, str | int | float | tuple[str, ...]] = {}
    for spec in PARAMS:
        value = getattr(params, spec.name)
        out[spec.name] = spec.kind() if value is None else value
    return out


def apply_changes(current: NodeParams, changes: Mapping[str, Any]) -> NodeParams:
    """current with changes made while the node runs. Raises ParamError for a read-only
    parameter (one that shapes the model or the subscription) or a bad value."""
    for name in changes:
        spec = _SPECS.get(name)
        if spec is None:
            raise ParamError(f"unknown parameter '{name}'")
        if not spec.runtime:
            raise ParamError(f"parameter '{name}' can only be set at start (restart the node to change it)")
    updated = validate({**as_values(current), **changes})
    # Only runtime parameters changed, so everything else is exactly as it was.
    return replace(current, **{name: getattr(updated, name) for name in changes})
