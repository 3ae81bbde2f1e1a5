"""The ROS 2 side: the node, its parameters, frame conversion, diagnostics, the camera publisher and
the demo monitor. The only subpackage that imports rclpy or ROS messages (see README.md)."""
