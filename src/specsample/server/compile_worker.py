"""The process a server starts to build its compiled decode steps apart (server/compile_behind.py): the engine options
as JSON in its first argument; exit status 0 once every step is built.

    python -m specsample.server.compile_worker '{"target": "smollm2-135m-instruct", ...}'
"""

from __future__ import annotations

import json
import logging
import sys

from specsample.options import EngineOptions
from specsample.precompile import compile_steps

log = logging.getLogger("specsample")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="specsample (compiling): %(message)s", force=True)
    compile_steps(EngineOptions(**json.loads(sys.argv[1])), log.info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
