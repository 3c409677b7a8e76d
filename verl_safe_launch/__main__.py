"""``python -m verl_safe_launch``: first, that this Python has the dependencies (a Ray job's may not)."""

import sys

from verl_safe_launch.environment import missing_dependency, missing_modules

if __name__ == "__main__":
    if missing := missing_modules():
        error = missing_dependency(missing)
        sys.stderr.write(error.render() + "\n")
        sys.exit(error.exit_code)
    from verl_safe_launch.cli import console_main

    console_main()
