"""The demo world, without ROS: the scene generator, the embedded demo model, the frame sources
(see README.md)."""
