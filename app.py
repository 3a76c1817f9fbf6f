"""Start the HiDream-E1 editing demo: `python app.py --help` lists the flags.

Same as `python -m hidream_ui app`. With no model flags it serves the offline tiny model
(results are noise); `--model-dir /path/to/models` selects the real weights.
"""

import sys

from hidream_ui.cli.app import main
from hidream_ui.cli.commands import run_main

if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
