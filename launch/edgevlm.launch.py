"""Starts the edgevlm node.

    ros2 launch edgevlm_ros edgevlm.launch.py image:=/camera/image_raw \
        model:=SmolVLM-256M-Instruct-Q8_0.gguf mmproj:=mmproj-SmolVLM-256M-Instruct-Q8_0.gguf

`lifecycle:=true` starts the managed lifecycle node instead (`edgevlm_lifecycle_node`: it comes
up unconfigured; `ros2 lifecycle set /edgevlm configure`, then `activate`).

Parameters come from `params_file` (default: this package's config/edgevlm.yaml); the `model`,
`mmproj`, `threads` and `transport` arguments override it only when given. `image` is the camera
topic: the node's `image` is remapped to it, and `image/compressed` to `<image>/compressed`
(image_transport's naming), so `transport:=compressed` needs no second remap.
"""

# ruff: noqa: I001 - ruff takes `launch` for this repository's launch/ folder and would sort it last
from pathlib import Path

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

# share/edgevlm_ros/launch/ -> share/edgevlm_ros/config/ when installed; launch/ -> config/ in a checkout.
DEFAULT_PARAMS = Path(__file__).resolve().parent.parent / "config" / "edgevlm.yaml"

ARGUMENTS = (
    ("image", "image", "camera image topic (sensor_msgs/Image; with transport compressed, <image>/compressed)"),
    ("model", "", "text model GGUF file; empty: the params file's value"),
    ("mmproj", "", "vision (mmproj) GGUF file; empty: the params file's value"),
    ("params_file", str(DEFAULT_PARAMS), "parameters YAML file"),
    ("namespace", "", "namespace of the node and its topics"),
    ("threads", "", "engine threads; empty: the params file's value"),
    ("transport", "", "raw or compressed; empty: the params file's value"),
    ("log_level", "info", "log level: debug, info, warn, error"),
    ("lifecycle", "false", "true: the managed lifecycle node (edgevlm_lifecycle_node), started unconfigured"),
)


def _edgevlm_node(context: object) -> list[Node]:
    def arg(name: str) -> str:
        return LaunchConfiguration(name).perform(context).strip()

    # Only the arguments that were given override the params file; values are typed here so the
    # node sees an integer thread count, not the string "2".
    overrides: dict[str, str | int] = {}
    for name in ("model", "mmproj", "transport"):
        if arg(name):
            overrides[name] = arg(name)
    if arg("threads"):
        try:
            overrides["threads"] = int(arg("threads"))
        except ValueError:
            raise ValueError(f"launch argument threads:={arg('threads')} is not an integer") from None
    image = arg("image")
    lifecycle = arg("lifecycle").lower()
    if lifecycle not in ("true", "false"):
        raise ValueError(f"launch argument lifecycle:={arg('lifecycle')} must be true or false")
    parameters: list[str | dict[str, str | int]] = [arg("params_file")]
    if overrides:
        parameters.append(overrides)
    return [
        Node(
            package="edgevlm_ros",
            executable="edgevlm_lifecycle_node" if lifecycle == "true" else "edgevlm_node",
            name="edgevlm",
            namespace=arg("namespace"),
            parameters=parameters,
            remappings=[("image", image), ("image/compressed", f"{image}/compressed")],
            ros_arguments=["--log-level", arg("log_level")],
            output="screen",
        )
    ]


def generate_launch_description() -> LaunchDescription:
    arguments = [DeclareLaunchArgument(name, default_value=default, description=description)
                 for name, default, description in ARGUMENTS]
    return LaunchDescription([*arguments, OpaqueFunction(function=_edgevlm_node)])
