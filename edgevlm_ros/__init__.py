"""edgevlm_ros."""
