"""A child process for the colcon install tests: `python test/install_probe.py` prints where the
edgevlm_ros it imports lives and the checkout it runs from ("None" for an installed package)."""

from __future__ import annotations

from edgevlm_ros.engine import paths


def main() -> int:
    print(paths.package_dir())
    print(paths.checkout_root())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
