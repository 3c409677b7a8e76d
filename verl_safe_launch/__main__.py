"""``python -m verl_safe_launch``."""

from verl_safe_launch.cli import console_main

if __name__ == "__main__":
    console_main()
