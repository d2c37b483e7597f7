"""Started by DeepSpeed's launcher in tests/runtime/test_failures.py: writes this rank's environment to
DIR/env{RANK}.json (argv: --local_rank=N DIR), to test what the launcher really sets."""
import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[-1])
(out / f"env{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
